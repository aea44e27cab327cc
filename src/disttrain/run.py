"""Worker entry point: `python -m disttrain.run CONFIG [--set k=v ...]`.

This is what `disttrain train --nproc N` starts on every rank through torchrun, and it can be used with
torchrun directly: `torchrun --nproc-per-node 2 -m disttrain.run runs/default/config.toml`.
"""

from __future__ import annotations

import argparse
import logging
import sys

from disttrain.backend import NonFiniteError
from disttrain.checkpoint import CheckpointError
from disttrain.config import ConfigError, load_config
from disttrain.runtime import Preempted, exit_process


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m disttrain.run")
    parser.add_argument("config", nargs="?", help="TOML config (default: the built-in job)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="disttrain: %(message)s")
    try:
        from disttrain.trainer import Trainer

        Trainer(load_config(args.config, args.overrides)).fit()
    except ConfigError as exc:
        print(f"disttrain: error: {exc}", file=sys.stderr)
        return 2
    except (CheckpointError, NonFiniteError) as exc:
        print(f"disttrain: error: {exc}", file=sys.stderr)
        return 1
    except Preempted as exc:
        print(f"disttrain: {exc}", file=sys.stderr)
        return exc.exit_code
    except MemoryError as exc:  # torch.OutOfMemoryError is a MemoryError too
        print(f"disttrain: error: out of memory ({exc}); lower data.micro_batch_size, set "
              "parallel.activation_checkpointing = true, use a sharded strategy or parallel.cpu_offload, and see "
              "`disttrain estimate-memory`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    exit_process(main())
