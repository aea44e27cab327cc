"""How a failure reaches the user: the exit code and the one line every entry point prints. The bottom layer
(imports nothing of disttrain, nor torch).

`ConfigError` lives here (not in the config package) because the strategy registry, below the config, raises it too.
`ConfigError`, `CheckpointError`, `NonFiniteError` and `Preempted` derive from `UserError`, so the CLI and the
worker entry point map them without importing the modules that raise them. Out-of-memory errors are recognised
by class: `MemoryError` (host) and `torch.OutOfMemoryError`, which is a `RuntimeError`, not a `MemoryError`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NoReturn

OOM_ADVICE = ("lower data.micro_batch_size, set parallel.activation_checkpointing = true, use a sharded strategy "
              "or parallel.cpu_offload, and see `disttrain estimate-memory`")


class UserError(Exception):
    """A failure the user can act on: printed as one line (no traceback), the process exits `exit_code`."""

    exit_code: int = 1
    prefix: str = "disttrain: error: "


class ConfigError(UserError, ValueError):
    """A user mistake in the configuration or the command line. The message is one line: setting, value, fix."""

    exit_code = 2


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad command line is one line too (argparse prints its usage first): the setting, what is
    wrong, where to look; exit 2, as for a ConfigError."""

    def error(self, message: str) -> NoReturn:
        print(f"{UserError.prefix}{message}; see `{self.prog} --help`", file=sys.stderr)
        raise SystemExit(2)


def make_folder(path: str | Path, setting: str) -> Path:
    """The folder the user named with `setting` (e.g. `--out`, `run.out_dir`), created with its parents; a path that
    cannot be a folder (a file is there, no permission) is a ConfigError naming the setting."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{setting} '{path}': cannot create the folder ({exc.strerror}); give a folder you can "
                          "write") from None
    return path


def is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, MemoryError) or any(c.__name__ == "OutOfMemoryError" for c in type(exc).__mro__)


def exit_code_and_message(exc: BaseException) -> tuple[int, str] | None:
    """(exit code, line to print) for a failure the user can act on; None for anything else (a bug: let its
    traceback show)."""
    if isinstance(exc, UserError):
        return exc.exit_code, f"{exc.prefix}{exc}"
    if is_out_of_memory(exc):
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return 1, f"disttrain: error: out of memory ({first}); {OOM_ADVICE}"
    return None


def exit_code(exc: BaseException) -> int:
    """Print the one line of a failure the user can act on and return its exit code; re-raise anything else."""
    known = exit_code_and_message(exc)
    if known is None:
        raise exc
    print(known[1], file=sys.stderr)
    return known[0]
