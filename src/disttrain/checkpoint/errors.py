"""The checkpoint package's errors: one line for the user, no traceback (`UserError`)."""

from __future__ import annotations

from disttrain.errors import UserError


class CheckpointError(UserError, RuntimeError):
    """A checkpoint could not be saved or no valid checkpoint could be loaded; the message says why."""


class ArrivalError(CheckpointError):
    """Some ranks did not call a collective save or load in time: the ranks are out of step, and no rank may go on as
    if it had only failed (`checkpoint.on_error = "continue"` does not apply)."""
