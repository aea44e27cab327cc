"""Build and run torchrun (torch.distributed.run, torch's own elastic launcher): one node or many,
with elastic restarts, a watchdog, per-rank logs and a failure summary.

The launcher prints the equivalent `torchrun` command, so what disttrain does is never a mystery and
can be reproduced by hand. Workers run `python -m disttrain.run CONFIG` (or a user script).
SIGINT/SIGTERM reach torchrun's agent, which forwards them to every worker (they finish the step and
checkpoint within `dist.shutdown_grace_s`); the exit code is 128 + signal. When a worker fails, torchrun
restarts the whole group up to `--max-restarts` times (each attempt resumes from the newest committed
checkpoint), then the job ends with a summary of every rank.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

from disttrain.config import NODE_CLAIM_ENV, ConfigError
from disttrain.console import DRAWS_ENV, Console
from disttrain.errors import make_folder

log = logging.getLogger(__name__)


@dataclass
class LaunchPlan:
    """Where and how many: one node on loopback by default."""

    nproc: int = 1
    nnodes: str = "1"  # "M" or elastic "MIN:MAX"
    node_rank: int = 0
    rdzv_endpoint: str | None = None  # HOST:PORT of the c10d rendezvous; None: loopback, any free port
    rdzv_id: str | None = None
    max_restarts: int = 0
    timeout_s: float = 300.0
    startup_timeout_s: float = 900.0
    shutdown_grace_s: float = 60.0

    @property
    def single_node(self) -> bool:
        return self.nnodes == "1"

    def check(self) -> None:
        if self.nproc < 1:
            raise ConfigError(f"dist.nproc = {self.nproc}: must be >= 1; use --nproc 1 or more")
        parts = self.nnodes.split(":")
        if not (1 <= len(parts) <= 2 and all(p.isdigit() and int(p) >= 1 for p in parts)
                and int(parts[0]) <= int(parts[-1])):
            raise ConfigError(f"--nnodes {self.nnodes}: use a number of nodes, or MIN:MAX for elastic, e.g. 2 or 1:4")
        if not self.single_node and not self.rdzv_endpoint:
            raise ConfigError(f"--nnodes {self.nnodes} needs --rdzv-endpoint HOST:PORT (the same on every node)")
        port = self.rdzv_endpoint.rpartition(":")[2] if self.rdzv_endpoint else "1"
        if self.rdzv_endpoint and (":" not in self.rdzv_endpoint or not port.isdigit() or not 1 <= int(port) <= 65535):
            raise ConfigError(f"--rdzv-endpoint {self.rdzv_endpoint}: expected HOST:PORT with a port from 1 to 65535, "
                              "e.g. 10.0.0.1:29400")
        if not 0 <= self.node_rank < int(parts[-1]):
            raise ConfigError(f"--node-rank {self.node_rank}: must be from 0 to {int(parts[-1]) - 1} with --nnodes "
                              f"{self.nnodes}; give each node its own rank")
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts {self.max_restarts}: must be >= 0")


def torchrun_argv(plan: LaunchPlan, entry: list[str], log_dir: Path, module: bool) -> list[str]:
    """torchrun arguments; a single node binds its rendezvous to loopback."""
    argv = ["--nnodes", plan.nnodes, "--nproc-per-node", str(plan.nproc), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", plan.rdzv_endpoint or "127.0.0.1:0",
            "--rdzv-id", plan.rdzv_id or (uuid.uuid4().hex[:12] if plan.single_node else "disttrain"),
            "--max-restarts", str(plan.max_restarts), "--log-dir", str(log_dir), "--redirects", "3",
            "--shutdown-timeout", str(int(plan.shutdown_grace_s + 10))]
    if plan.single_node:
        argv += ["--local-addr", "127.0.0.1"]
    else:  # a node that never joins ends the rendezvous after the start-up limit, not torchrun's 600 s; node 0
        # hosts the rendezvous store, the others are its clients (torchrun would guess from the host name, and
        # on one machine every node matches it: two could each host a store and never meet)
        host = str(plan.node_rank == 0).lower()
        argv += ["--rdzv-conf", f"join_timeout={int(plan.startup_timeout_s)},is_host={host}"]
    return argv + (["-m"] if module else []) + entry


def launch(plan: LaunchPlan | int, entry: list[str], run_dir: Path, module: bool = True,
           progress_total: int = 0, fork: bool = False) -> int:
    """Run `entry` on this node's workers through torchrun; return the job's exit code. The workers' output reaches
    this terminal line by line with its rank; `progress_total` > 0 (a `disttrain train` job): one progress bar drawn
    from rank 0's `run_dir/metrics.jsonl` (console.py). disttrain's own workers (`disttrain train`'s, the benchmarks',
    `verify`'s) are forked from a preloaded server (launch_fork.py); another entry too with `fork` (torch is then
    imported before it runs), else it runs as torchrun's subprocess."""
    plan = LaunchPlan(nproc=plan) if isinstance(plan, int) else plan
    plan.check()
    tmp = make_folder(run_dir, "the run folder") / "tmp"
    tmp.mkdir(exist_ok=True)
    import tempfile

    # torchrun's per-run folders land in the run (it makes them here, in this process); the workers keep the
    # caller's TMPDIR: a run folder deep in a file system would make the sockets multiprocessing names after it
    # (data loader workers pass batches through them) longer than AF_UNIX allows
    saved, tempfile.tempdir = tempfile.tempdir, str(tmp)
    try:
        return _run_torchrun(plan, entry, run_dir, module, progress_total, fork)
    finally:  # called in-process (tests, notebooks): leave the caller's temp folder as it was
        tempfile.tempdir = saved


def _run_torchrun(plan: LaunchPlan, entry: list[str], run_dir: Path, module: bool, progress_total: int = 0,
                  fork: bool = False) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousError
    from torch.distributed.run import get_args_parser, run

    from disttrain.launch_fork import forks, run_forked
    from disttrain.monitor import WATCHED_ENV, clear_statuses, mark_ended
    from disttrain.watchdog import Watchdog, summary

    argv = torchrun_argv(plan, entry, run_dir / "logs", module)
    print("disttrain: launching: torchrun " + shlex.join(argv), file=sys.stderr, flush=True)
    # The entry's own arguments are attached after parsing: torchrun's argparse would otherwise take a
    # script flag such as --nproc=2 for an abbreviation of its own --nproc-per-node.
    args = get_args_parser().parse_args(argv[:len(argv) - len(entry) + 1])
    args.training_script_args = entry[1:]
    if plan.node_rank == 0:
        clear_statuses(run_dir)
    if not plan.single_node and plan.node_rank != 0:
        _reach_rendezvous(plan)
    watchdog = Watchdog(run_dir, plan.timeout_s, plan.startup_timeout_s)
    console = Console(run_dir / "logs", run_dir / "metrics.jsonl" if progress_total else None, progress_total)
    exported = {DRAWS_ENV: "1" if progress_total else "0",  # the workers inherit it: no bar of their own
                WATCHED_ENV: str(run_dir.resolve())}  # their statuses come here, whatever run.out_dir they train in
    if not plan.single_node:  # the workers check that no other node was given this --node-rank (runtime.py)
        exported[NODE_CLAIM_ENV] = f"{plan.node_rank}@{plan.rdzv_endpoint}"
    saved = {name: os.environ.get(name) for name in exported}
    os.environ.update(exported)
    console.start()
    try:
        with watchdog:
            (run_forked if fork or forks(entry[0], module) else run)(args)
    except RendezvousConnectionError:
        console.stop()
        if plan.node_rank == 0:  # node 0 could not open the store's port
            raise RendezvousFailed(
                f"node 0 could not host the rendezvous at {plan.rdzv_endpoint}: its port is taken, by another node "
                "also given --node-rank 0 or by another program; give each node its own --node-rank, or choose a "
                "free port for --rdzv-endpoint") from None
        raise RendezvousFailed(_rendezvous_advice(plan, "could not be reached")) from None
    except RendezvousError as exc:
        console.stop()
        raise RendezvousFailed(_rendezvous_advice(plan, f"did not complete within {plan.startup_timeout_s:g} s "
                                                        f"({type(exc).__name__})")) from None
    except ChildFailedError as exc:
        console.stop()
        failures = {rank: _describe(f) for rank, f in exc.failures.items()}
        if not plan.single_node:  # the other nodes' ranks may wait for these in a collective: their launchers look
            mark_ended(run_dir, failures)
        if {f.exitcode for f in exc.failures.values()} != {2}:  # exit 2 everywhere: each printed its one line
            print(summary(run_dir, failures, watchdog.stuck, watchdog.ended, watchdog.stacks), file=sys.stderr,
                  flush=True)
        return _exit_code(exc)
    except SignalException as exc:
        console.stop()
        print(f"disttrain: stopped by {exc.sigval.name}; every rank finished its step and exited",
              file=sys.stderr)
        return 128 + int(exc.sigval)
    finally:
        console.stop()
        for name, value in saved.items():  # called in-process (tests, notebooks): leave the environment as it was
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return 0


class RendezvousFailed(ConfigError):
    """The nodes of a multi-node job did not meet (one line: the endpoint, the nodes, what to check)."""


def _rendezvous_advice(plan: LaunchPlan, what: str) -> str:
    nodes = plan.nnodes.split(":")[0]
    return (f"the rendezvous at {plan.rdzv_endpoint} (job id {plan.rdzv_id or 'disttrain'}, {nodes} node(s) "
            f"expected, this is node {plan.node_rank}) {what}; check that node 0 started with the same "
            "--rdzv-endpoint and --rdzv-id, that every node started, the firewall, and NCCL_SOCKET_IFNAME / "
            "GLOO_SOCKET_IFNAME on machines with several network interfaces (dist.startup_timeout_s sets the wait)")


def _reach_rendezvous(plan: LaunchPlan) -> None:
    """A node other than node 0 connects to the rendezvous endpoint before starting anything, retrying until
    `startup_timeout_s` (node 0 may start later): an endpoint nobody listens on is named, not waited on."""
    import socket
    import time

    host, _, port = plan.rdzv_endpoint.rpartition(":")
    deadline = time.monotonic() + plan.startup_timeout_s
    error: OSError | None = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, int(port)), timeout=max(1.0, min(5.0, deadline - time.monotonic()))):
                return
        except OSError as exc:
            error = exc
            time.sleep(0.5)
    raise RendezvousFailed(_rendezvous_advice(plan, f"could not be reached within {plan.startup_timeout_s:g} s "
                                                    f"({error.strerror or error})"))


def _describe(failure) -> str:
    code = failure.exitcode
    return f"killed by signal {failure.signal_name()}" if code < 0 else f"exited with code {code}"


def _exit_code(exc) -> int:
    """A worker's own exit code 2 (a user error, already explained) passes through; otherwise the code of the
    first rank that failed by itself (ranks stopped by torchrun's SIGTERM are followers, not the cause)."""
    own = [f.exitcode for _, f in sorted(exc.failures.items()) if f.exitcode > 0]
    return 2 if 2 in own else (own[0] if own else 1)
