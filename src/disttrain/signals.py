"""Stopping on a signal: SIGTERM / SIGINT ask a run to finish its step (and checkpoint) and stop (`StopSignals`,
`Preempted`); the handlers are installed in the main thread only and restored on leaving."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from disttrain.errors import UserError
from disttrain.runtime import detect_launch, exit_process


class Preempted(UserError):
    """Training stopped on SIGTERM/SIGINT after finishing a step (and checkpointing, if enabled)."""

    prefix = "disttrain: "

    def __init__(self, step: int, signum: int = signal.SIGTERM):
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}")
        self.step, self.signum = step, signum

    @property
    def exit_code(self) -> int:
        return 128 + int(self.signum)


def install_stop_handler(handler) -> dict[int, Any]:
    """`handler` for SIGTERM and SIGINT, in the main thread only (elsewhere Python cannot install one: nothing is
    changed); returns the handlers it replaced, for `restore_handlers`."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}


def restore_handlers(previous: dict[int, Any]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


class StopSignals:
    """SIGTERM/SIGINT ask for a graceful stop: `on_signal()` is called (the Trainer asks all ranks to stop
    after the current step and checkpoint), and if the process is still alive `grace_s` later (stuck in a
    collective or in user code) it exits with 128 + signal. When `peer_failed()` says another rank already
    failed (torchrun stopping the group to restart it), the process exits at once instead: there is no
    step to finish with a dead peer. Handlers are installed only in the main thread and restored on exit.

    Once the run has ended after a signal (stopped after its step, or ended as it would have: the signal came with
    the last step or checkpoint), a launched rank has `LEFT_S` to leave, not the rest of `grace_s` (in a process of
    the caller's own, one not launched, the timer is cancelled: the run is over and the process goes on): nothing
    is left to save, and the launcher that sent the signal is closing the group rather than collecting the rank's
    result (torch's agent stops reading forked ranks' return values once it is shutting down, and a rank waiting
    to hand its own over would otherwise sit out the whole grace: a SIGTERM 10 ms after a job's last step kept
    `disttrain train` alive 60 s)."""

    LEFT_S = 5.0
    """After a run that ended with a stop signal pending: the rank's remaining shutdown (a barrier, destroying the
    process group: well under a second) and the launcher's collection of its result, if it still collects."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.on_signal = lambda: None
        self.peer_failed = lambda: False  # torchrun also sends SIGTERM when a peer died: then exit at once
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        self._timer: threading.Timer | None = None

    def __enter__(self) -> StopSignals:
        self._previous = install_stop_handler(self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.signum is not None or self.peer_failed():
            exit_process(128 + signum)  # a second signal, or the group is being torn down for a restart
        self.signum = signum
        self.on_signal()
        self._leave_after(self.grace_s)

    def _leave_after(self, seconds: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = threading.Timer(seconds, exit_process, args=(128 + self.signum,))
        self._timer.daemon = True
        self._timer.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        restore_handlers(self._previous)
        if isinstance(exc, Preempted) and self.signum is not None:
            exc.signum = self.signum
        if self.signum is None or self._timer is None:  # (no timer: `on_signal` itself raised)
            return
        if detect_launch(os.environ).launcher == "single":  # the caller's own process: the run is over, it goes on
            self._timer.cancel()
        elif self.grace_s > self.LEFT_S:  # a launched rank: it leaves soon, whatever it is left waiting for
            self._leave_after(self.LEFT_S)
