"""The command line: main.py (argument parsing and dispatch), ckpt.py (`disttrain ckpt`), verify.py
(`disttrain verify`), env.py (`disttrain env`), docs.py (the generated docs/config.md)."""

from disttrain.cli.main import main

__all__ = ["main"]
