"""Who is doing what: per-rank status files (worker side), and what the launcher reads of them (the watchdog and the
failure summary are in watchdog.py).

Each rank keeps `RUN_DIR/status/rank<R>.json` current (RUN_DIR: the folder its launcher watches, `WATCHED_ENV`,
where a script's `run.out_dir / run.name` differs from `disttrain launch --run-dir`; else the run's own): node, pid,
attempt, last completed step, the phase it is in (startup, data, forward, backward, optimizer, eval, checkpoint, done)
and since when, its job's time limits, and, if it failed, the exception and the last lines of its traceback. A
background thread rewrites the file once a second (a heartbeat; the main thread only updates a dict), and immediately
on errors.

The launcher reads these files: its watchdog SIGKILLs the job when a rank has made no progress for longer
than `dist.timeout_s` (a longer `dist.startup_timeout_s` before the first step completes, and no limit
while a checkpoint is being written), and the summary it prints when a job fails names the ranks, their
exit codes or signals, exceptions, phases and last steps. On several nodes, a launcher that gives up on its
failed ranks records how they ended in their files (`mark_ended`), and the other nodes' watchdogs stop their
ranks at once: they may be waiting for a dead peer in a collective that never returns (nccl).
"""

from __future__ import annotations

import faulthandler
import json
import math
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

STATUS_DIR = "status"
STACK_SIGNAL = signal.SIGUSR2
"""Asks a rank for every thread's Python stack (`RankStatus`), which the watchdog sends a stuck rank before killing it.
(SIGUSR1 is Slurm's and Lightning's usual preemption warning.)"""
STACK_LINES = 12
UNTIMED_PHASES = frozenset({"done", "checkpoint", "launcher gone"})
"""Phases the watchdog puts no time limit on (a checkpoint may take as long as the storage needs)."""
PROBE_AT = 0.5
"""A rank's heartbeat, once it has been in one phase for this fraction of its time limit, also says whether it waits
in a collective (`CollectiveProbe`), so that the watchdog names the rank its peers wait for, not them
(`the_waited_for`). Not sooner, and then every `PROBE_EVERY_S`: reading the flight recorder takes ~0.2 s (2000
records), on the heartbeat's thread but holding the GIL."""
PROBE_EVERY_S = 5.0
LIVE_HEARTBEAT_S = 10.0
"""A rank whose heartbeat (once a second) is older than this is not asked for dumps by `disttrain status --dump`."""
DUMP_REQUEST = "dump_request"
"""Touched by the watchdog in the status folder: each rank's heartbeat thread answers with its flight recorder's
records of its collectives (`rank<R>.collectives.json`)."""


WATCHED_ENV = "DISTTRAIN_WATCHED_RUN_DIR"
"""Set by the launcher for its workers: the run folder whose status files its watchdog reads. A script launched by
`disttrain launch --run-dir D` may train into any `run.out_dir`: its ranks' statuses still go to D, so that a hang
is named (and `disttrain status D` finds them)."""


def watched(run_dir: Path) -> Path:
    """Where this process's rank statuses go: its launcher's run folder, else `run_dir`."""
    return Path(os.environ.get(WATCHED_ENV) or run_dir)


def status_dir(run_dir: Path) -> Path:
    return Path(run_dir) / STATUS_DIR


class RankStatus:
    """This rank's status file, in the folder its launcher watches (`watched`). `phase()` is cheap (a dict update); a
    thread writes the file."""

    def __init__(self, run_dir: Path, rank: int, node: int, interval_s: float = 1.0,
                 limits: tuple[float, float] | None = None):
        """`limits`: this job's (`dist.timeout_s`, `dist.startup_timeout_s`), for the watchdog (its own otherwise)."""
        self.run_dir = watched(run_dir)
        # a torchrun worker runs in a session of its own: if its launcher dies (SIGKILL, the OOM killer) nothing
        # would end it, and a rank blocked outside a collective (a data loader, a sleep) would outlive the job.
        # The heartbeat notices the parent change and ends the rank.
        self._launcher = os.getppid() if os.environ.get("TORCHELASTIC_RUN_ID") else None
        self.path = status_dir(self.run_dir) / f"rank{rank}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        now = time.time()
        self.state: dict[str, Any] = {
            "rank": rank, "node": node, "host": socket.gethostname(), "pid": os.getpid(),
            "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)), "step": 0, "phase": "startup",
            "since": now, "heartbeat": now,
        }
        if limits is not None:
            self.state["timeout_s"], self.state["startup_timeout_s"] = limits
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._beat, args=(interval_s,), name="disttrain-status", daemon=True)
        self._dumped = mtime(self.path.parent / DUMP_REQUEST)  # (a request left by an earlier run is not for us)
        self._stacks = _stacks_on_request(self.path.with_suffix(".stack"))
        self._probe = CollectiveProbe()
        self.state["stacks"] = self._stacks is not None  # the watchdog signals only a rank that answers
        self.write()
        self._thread.start()

    def phase(self, name: str, step: int | None = None) -> None:
        self.state["phase"] = name
        self.state["since"] = time.time()
        if step is not None:
            self.state["step"] = step

    def error(self, exc: BaseException) -> None:
        lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
        self.state["error"] = {"type": type(exc).__name__, "message": str(exc).splitlines()[0] if str(exc) else "",
                               "traceback": "".join(lines).splitlines()[-8:], "phase": self.state["phase"]}
        self.write()

    def write(self) -> None:
        with self._lock:
            self.state["heartbeat"] = time.time()
            long = self.state["heartbeat"] - self.state["since"] > PROBE_AT * limit(self.state)  # (none: never)
            if long and self.state["phase"] not in UNTIMED_PHASES:  # waiting on a peer?
                self.state["in_collective"] = self._probe((self.state["phase"], self.state["since"]))
            else:
                self.state.pop("in_collective", None)
            _write_json(self.path, self.state)

    def _beat(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            if self._launcher is not None and os.getppid() != self._launcher:
                self._orphaned()
            try:
                self.write()
                self._answer_dump_request()
            except OSError:
                pass  # a full disk must not kill training; the next beat tries again

    def _answer_dump_request(self) -> None:
        """Write this rank's flight-recorder records if the watchdog asked since the last answer. From this thread,
        which runs while the main thread waits in a collective (torch releases the GIL there)."""
        asked = mtime(self.path.parent / DUMP_REQUEST)
        if asked <= self._dumped:
            return
        self._dumped = asked
        _write_json(self.path.with_suffix(".collectives.json"), collective_records())

    def _orphaned(self) -> None:
        print(f"disttrain: rank {self.state['rank']}: its launcher (pid {self._launcher}) is gone; exiting",
              file=sys.stderr, flush=True)
        self.phase("launcher gone")
        try:
            self.write()
        finally:
            os._exit(1)  # (the main thread may be blocked anywhere: no clean-up can be waited for)

    def close(self, phase: str | None = "done") -> None:
        """Stop the heartbeat; `phase=None` keeps the phase the rank was in (where it failed)."""
        if phase is not None:
            self.phase(phase)
        self._stop.set()
        self._thread.join()
        stacks, self._stacks = self._stacks, None
        self.state["stacks"] = False  # first: STACK_SIGNAL's default action would now end the process
        self.write()
        if stacks is not None:  # (the signal's disposition is the default again, as before: not ignored, which child
            faulthandler.unregister(STACK_SIGNAL)  # processes would inherit, and then never register for it)
            stacks.close()


def _write_json(path: Path, value: Any, tmp_suffix: str = ".tmp") -> None:
    """`value` as JSON, replacing `path` whole: a reader (another node's watchdog) never sees half a file."""
    tmp = path.with_name(f".{path.name}{tmp_suffix}")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def _stacks_on_request(path: Path):
    """faulthandler writes every thread's Python stack to `path` on STACK_SIGNAL, from a C signal handler: a rank
    blocked in a collective or a C call answers too. Only where the signal is free: a Python handler of the user's
    stays (a `faulthandler.register` of the user's own on that signal cannot be seen, and is replaced until `close`).
    Returns the open file (kept open: faulthandler writes to its descriptor), or None."""
    if signal.getsignal(STACK_SIGNAL) not in (signal.SIG_DFL, None):
        return None
    path.write_text("")
    stacks = open(path, "a")  # (open until `close`; appending: each requester reads from where its dump starts)
    faulthandler.register(STACK_SIGNAL, file=stacks, all_threads=True)
    return stacks


def mtime(path: Path, field: str = "st_mtime_ns") -> int:
    """The file's modification time in ns (or another `os.stat` field: "st_size"); 0 where there is no file."""
    try:
        return getattr(path.stat(), field)
    except OSError:
        return 0


def collective_records() -> dict[str, Any]:
    """This process's flight-recorder records (torch's JSON dump: `entries`, one per collective, newest last), or
    none where no process group formed or the recorder is off."""
    dist = sys.modules.get("torch.distributed")  # (never imports torch: the launcher imports this module)
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return {"entries": [], "note": "no process group"}
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json

        return json.loads(_dump_fr_trace_json(True, False))
    except Exception as exc:  # a torch without it, or a recorder that cannot dump: say so rather than fail
        return {"entries": [], "note": f"no records: {type(exc).__name__}: {exc}"}


def limit(status: dict, timeout_s: float = math.inf, startup_timeout_s: float = math.inf) -> float:
    """How long a rank may go without progress: the limit its status carries (its job's `dist.timeout_s`, or
    `dist.startup_timeout_s` before its first step), else the one given (the launcher's)."""
    if status["step"] == 0:
        return status.get("startup_timeout_s", startup_timeout_s)
    return status.get("timeout_s", timeout_s)


def the_waited_for(over: list[T], live: list[T], since: Callable[[T], float], waiting: Callable[[T], bool]
                   ) -> list[T]:
    """Of the ranks past their time limit (`over`), those the others wait for: the ones not waiting in a collective
    themselves (a rank stuck in its own code, or in a collective its peers never started). Where all of them wait in
    one, the rank they wait for may still be within its own limit (it entered its phase later): then the ranks in a
    timed phase (`live`) that do not wait in one, if any, else all. Of these, the ones in their phase the longest
    (within a second)."""
    suspects = [r for r in over if not waiting(r)] or [r for r in live if not waiting(r)] or over
    oldest = min(map(since, suspects))
    return [r for r in suspects if since(r) - oldest < 1.0]


class CollectiveProbe:
    """Is this process waiting in a collective (its flight recorder holds an unfinished record)? Read again
    `PROBE_EVERY_S` after the last read, or at once in another phase (`phase`: one that began at a given time)."""

    def __init__(self) -> None:
        self.read_at, self.phase, self.waiting = -math.inf, None, False

    def __call__(self, phase: tuple) -> bool:
        now = time.monotonic()
        if phase != self.phase or now - self.read_at >= PROBE_EVERY_S:
            entries = collective_records().get("entries") or []
            self.read_at, self.phase, self.waiting = now, phase, any(not e.get("retired") for e in entries)
        return self.waiting


def waits(records: dict[int, dict[str, Any]], now_ns: int | None = None) -> list[str]:
    """What each rank's collectives say (`records`: rank -> its flight-recorder dump): the collective it waits in
    (its oldest unfinished one), else its last; then, per process group, the ranks that never reached the newest
    collective another rank started (the one the others wait for)."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    # newest: (group's name, p2p) -> {rank: newest sequence number}; a group's members are the ranks with records in
    # it (the groups of one mesh dimension share a description, not a name)
    lines, newest, shown = [], {}, {}
    for rank, dump in sorted(records.items()):
        entries = dump.get("entries") or []
        for e in entries:
            key = ((e.get("process_group") or ["?"])[0], bool(e.get("is_p2p")))
            shown[key[0]] = _group(e)
            seq = e.get("p2p_seq_id" if key[1] else "collective_seq_id", 0)
            newest.setdefault(key, {})[rank] = max(seq, newest.get(key, {}).get(rank, 0))
        waiting = [e for e in entries if not e.get("retired")]
        if waiting:
            e = waiting[0]
            age = (now_ns - e.get("time_created_ns", now_ns)) / 1e9
            lines.append(f"rank {rank}: waiting in {_describe(e)}, for {age:.0f} s")
        elif entries:
            lines.append(f"rank {rank}: none unfinished; its last: {_describe(entries[-1])}")
        else:
            lines.append(f"rank {rank}: no collective recorded" + (f" ({dump['note']})" if dump.get("note") else ""))
    for (name, p2p), seqs in sorted(newest.items()):
        top = max(seqs.values())
        behind = sorted(r for r, seq in seqs.items() if seq < top)
        if behind and not p2p:
            last = min(seqs[r] for r in behind)
            lines.append(f"{shown[name]}: rank(s) {', '.join(map(str, behind))} never started collective #{last + 1} "
                         f"(their last: {', '.join(f'#{seqs[r]}' for r in behind)}), which the others did "
                         f"(they went on to #{top})")
    return lines


def _group(entry: dict[str, Any]) -> str:
    name, desc = (list(entry.get("process_group") or ["?", ""]) + [""])[:2]
    if desc == "default_pg":
        return desc
    return f"{desc} (group {name})" if desc and desc != "undefined" else f"group {name}"


def _describe(entry: dict[str, Any]) -> str:
    p2p = entry.get("is_p2p")
    seq = entry.get("p2p_seq_id" if p2p else "collective_seq_id", "?")
    sizes = entry.get("input_sizes") or []
    dtypes = entry.get("input_dtypes") or []
    shape = f" {dtypes[0]} {list(sizes[0])}" if sizes and dtypes else ""
    return f"{entry.get('profiling_name', '?')}{shape} #{seq} of {_group(entry)}"


def main_stack(dump: str, lines: int = STACK_LINES) -> list[str]:
    """The frames of the main thread (most recent first, at most `lines`) in a faulthandler dump of every thread: the
    thread whose oldest frame is not `threading`'s bootstrap."""
    blocks, block = [], []
    for line in dump.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            block = []
            blocks.append(block)
        elif line.strip().startswith("File ") and blocks:
            block.append(line.strip())
    main = [b for b in blocks if b and "in _bootstrap" not in b[-1]]
    return main[0][:lines] if main else []


def peer_failed(run_dir: Path, rank: int, attempt: int) -> bool:
    """Has another rank of this attempt raised, or died (on this host)?"""
    for s in read_statuses(run_dir):
        if s["rank"] == rank or s.get("attempt") != attempt:
            continue
        if "error" in s:
            return True
        if s["host"] == socket.gethostname():
            try:
                os.kill(s["pid"], 0)
            except ProcessLookupError:
                return s["phase"] != "done"
    return False


def read_statuses(run_dir: Path) -> list[dict[str, Any]]:
    out = []
    for path in sorted(status_dir(run_dir).glob("rank*.json")):
        if not path.stem[4:].isdigit():  # (rank<R>.collectives.json)
            continue
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue  # being replaced right now
    return sorted(out, key=lambda s: s["rank"])


def mark_ended(run_dir: Path, failures: dict[int, str]) -> None:
    """Launcher, once its node's workers failed and it gave up: how each ended (`failures`: rank -> "killed by signal
    SIGKILL", ...), written into its status file. The other nodes' launchers cannot see this node's processes, and
    their ranks may wait for a dead one in a collective that never returns (nccl): their `Watchdog` reads this."""
    for rank, how in failures.items():
        path = status_dir(run_dir) / f"rank{rank}.json"
        try:
            state = json.loads(path.read_text())
            state["ended"] = how
            _write_json(path, state, tmp_suffix=".ended.tmp")  # (not the rank's own temporary name)
        except (OSError, ValueError):
            continue  # no status (it died before writing one): the other nodes fall back on their timeout


def clear_statuses(run_dir: Path) -> None:
    folder = status_dir(run_dir)
    for path in [*folder.glob("rank*.json"), *folder.glob("rank*.stack"), folder / DUMP_REQUEST]:
        path.unlink(missing_ok=True)
