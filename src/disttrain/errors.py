"""The errors a user can cause, and how each ends a process: the bottom layer, imported by every other.

A `UserError` is a mistake or an outside condition the user can fix; its message is one line naming the
setting, the value and the fix, and `exit_code` is what the process returns (no traceback). `describe_exit`
is the one place that turns an exception into that line and code, for `disttrain ...` and for the worker
entry point alike.
"""

from __future__ import annotations

OUT_OF_MEMORY_ADVICE = ("lower data.micro_batch_size, set parallel.activation_checkpointing = true, use a sharded "
                        "strategy or parallel.cpu_offload, and see `disttrain estimate-memory`")


class UserError(Exception):
    """Ends the run with one line and `exit_code`, no traceback."""

    exit_code = 1


class ConfigError(UserError, ValueError):
    """A user mistake in the configuration or the command line. The message is one line: setting, value, fix."""

    exit_code = 2


def describe_exit(exc: BaseException) -> tuple[int, str] | None:
    """(exit code, the line to print) for an exception that ends a run cleanly; None for a bug (let it raise).

    Out of memory is `torch.OutOfMemoryError`, a RuntimeError (not a MemoryError), or a host MemoryError."""
    if isinstance(exc, UserError):
        return exc.exit_code, f"disttrain: error: {exc}"
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return 1, f"disttrain: error: out of memory ({first}); {OUT_OF_MEMORY_ADVICE}"
    return None
