"""Worker entry point: `python -m disttrain.run CONFIG [--set k=v ...]`.

This is what `disttrain train --nproc N` starts on every rank through torchrun, and it can be used with
torchrun directly: `torchrun --nproc-per-node 2 -m disttrain.run runs/default/config.toml`.
"""

from __future__ import annotations

import logging

from disttrain.config import load_config
from disttrain.errors import ArgumentParser, exit_code
from disttrain.runtime import exit_process


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m disttrain.run")
    parser.add_argument("config", nargs="?", help="TOML config (default: the built-in job)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="disttrain: %(message)s")
    try:
        from disttrain.trainer import Trainer

        Trainer(load_config(args.config, args.overrides)).fit()
    except Exception as exc:
        return exit_code(exc)  # the same line and exit code as `disttrain train` in one process
    return 0


if __name__ == "__main__":
    exit_process(main())
