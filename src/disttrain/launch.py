"""Build and run torchrun (torch.distributed.run, torch's own elastic launcher) for N local processes.

The launcher prints the equivalent `torchrun` command, so what disttrain does is never a mystery and
can be reproduced by hand. Workers run `python -m disttrain.run CONFIG` (or a user script).
SIGINT/SIGTERM reach torchrun's agent, which stops every worker; the exit code is 128 + signal.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
import uuid
from pathlib import Path

log = logging.getLogger(__name__)


def torchrun_argv(nproc: int, entry: list[str], log_dir: Path, module: bool) -> list[str]:
    """torchrun arguments for one node with `nproc` workers; the rendezvous binds to loopback."""
    argv = [
        "--nnodes", "1",
        "--nproc-per-node", str(nproc),
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", "127.0.0.1:0",
        "--rdzv-id", uuid.uuid4().hex[:12],
        "--local-addr", "127.0.0.1",
        "--max-restarts", "0",
        "--log-dir", str(log_dir),
    ]
    return argv + (["-m"] if module else []) + entry


def launch(nproc: int, entry: list[str], run_dir: Path, module: bool = True) -> int:
    """Run `entry` on `nproc` local processes through torchrun; return the job's exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    tmp = run_dir / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    os.environ["TMPDIR"] = str(tmp)  # torchrun's per-run folders land in the run, not in /tmp
    import tempfile

    tempfile.tempdir = str(tmp)
    argv = torchrun_argv(nproc, entry, run_dir / "logs", module)
    print("disttrain: launching: torchrun " + shlex.join(argv), file=sys.stderr, flush=True)
    # The entry's own arguments are attached after parsing: torchrun's argparse would otherwise take a
    # script flag such as --nproc=2 for an abbreviation of its own --nproc-per-node.
    args = get_args_parser().parse_args(argv[:len(argv) - len(entry) + 1])
    args.training_script_args = entry[1:]
    try:
        run(args)
    except ChildFailedError as exc:
        return _report_failure(exc)
    except SignalException as exc:
        print(f"disttrain: stopped by {exc.sigval.name}; all ranks were terminated", file=sys.stderr)
        return 128 + int(exc.sigval)
    return 0


def _report_failure(exc) -> int:
    """One line per failed rank; a worker's own exit code 2 (a user error, already explained) passes through."""
    codes = []
    for rank, failure in sorted(exc.failures.items()):
        code = failure.exitcode
        what = f"signal {failure.signal_name()}" if code < 0 else f"exit code {code}"
        print(f"disttrain: rank {rank} failed with {what}", file=sys.stderr)
        codes.append(128 - code if code < 0 else code)
    return 2 if 2 in codes else (codes[0] if codes else 1)
