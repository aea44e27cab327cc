"""Who is doing what: per-rank status files (worker side), and the launcher's watchdog and failure summary.

Each rank keeps `RUN_DIR/status/rank<R>.json` current: node, pid, attempt, last completed step, the phase
it is in (startup, data, forward, backward, optimizer, eval, checkpoint, done) and since when, and, if it
failed, the exception and the last lines of its traceback. A background thread rewrites the file once a
second (a heartbeat; the main thread only updates a dict), and immediately on errors.

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
import os
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

STATUS_DIR = "status"
STACK_SIGNAL = signal.SIGUSR2
"""Asks a rank for every thread's Python stack (`RankStatus`), which the watchdog sends a stuck rank before killing it.
(SIGUSR1 is Slurm's and Lightning's usual preemption warning.)"""
STACK_LINES = 12
LIVE_HEARTBEAT_S = 10.0
"""A rank whose heartbeat (once a second) is older than this is not asked for dumps by `disttrain status --dump`."""
DUMP_REQUEST = "dump_request"
"""Touched by the watchdog in the status folder: each rank's heartbeat thread answers with its flight recorder's
records of its collectives (`rank<R>.collectives.json`)."""


def status_dir(run_dir: Path) -> Path:
    return Path(run_dir) / STATUS_DIR


class RankStatus:
    """This rank's status file. `phase()` is cheap (a dict update); a thread writes the file."""

    def __init__(self, run_dir: Path, rank: int, node: int, interval_s: float = 1.0):
        # a torchrun worker runs in a session of its own: if its launcher dies (SIGKILL, the OOM killer) nothing
        # would end it, and a rank blocked outside a collective (a data loader, a sleep) would outlive the job.
        # The heartbeat notices the parent change and ends the rank.
        self._launcher = os.getppid() if os.environ.get("TORCHELASTIC_RUN_ID") else None
        self.path = status_dir(run_dir) / f"rank{rank}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        now = time.time()
        self.state: dict[str, Any] = {
            "rank": rank, "node": node, "host": socket.gethostname(), "pid": os.getpid(),
            "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)), "step": 0, "phase": "startup",
            "since": now, "heartbeat": now,
        }
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._beat, args=(interval_s,), name="disttrain-status", daemon=True)
        self._dumped = _mtime(self.path.parent / DUMP_REQUEST)  # (a request left by an earlier run is not for us)
        self._stacks = _stacks_on_request(self.path.with_suffix(".stack"))
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
        asked = _mtime(self.path.parent / DUMP_REQUEST)
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


def _mtime(path: Path, field: str = "st_mtime_ns") -> int:
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


# ----------------------------------------------------------------------------------------------
# Launcher side


def stuck_ranks(statuses: list[dict], timeout_s: float, startup_timeout_s: float, now: float | None = None
                ) -> list[dict]:
    """Ranks that have made no progress for longer than their limit. While one rank hangs, its peers wait
    for it inside a collective, so only the rank(s) stuck the longest are named."""
    now = time.time() if now is None else now
    over = []
    for s in statuses:
        if s["phase"] in ("done", "checkpoint") or "error" in s:
            continue
        limit = startup_timeout_s if s["step"] == 0 else timeout_s
        if now - s["since"] > limit:
            over.append(s)
    if not over:
        return []
    oldest = min(s["since"] for s in over)
    return [s for s in over if s["since"] - oldest < 1.0]


def summary(run_dir: Path, failures: dict[int, str] | None = None, stuck: list[dict] | None = None,
            ended: list[dict] | None = None, stacks: dict[int, int] | None = None) -> str:
    """The failure report: one line per rank, then the exception of the first rank that raised; for a hang, the
    stuck ranks' stacks (`stacks`: the watchdog's `ask_for_dumps`) and the collectives."""
    failures = failures or {}
    stuck_set = {s["rank"] for s in stuck or []}
    statuses = read_statuses(run_dir)
    now = time.time()
    lines = ["disttrain: job failed. Rank summary (last completed step, phase, state):"]
    for s in statuses:
        state = "STUCK, no progress for %.0fs" % (now - s["since"]) if s["rank"] in stuck_set else \
            failures.get(s["rank"], "raised " + s["error"]["type"] if "error" in s else
                         s["ended"] + " (its node's launcher says)" if "ended" in s else "stopped by the launcher")
        lines.append(f"  rank {s['rank']} (node {s['node']}, {s['host']}, pid {s['pid']}): step {s['step']}, "
                     f"phase {s['phase']}: {state}")
    raised = [s for s in statuses if "error" in s]
    if raised:
        first = min(raised, key=lambda s: s["heartbeat"])  # the first to fail; the others often follow from it
        lines.append(f"rank {first['rank']} raised {first['error']['type']} at step {first['step'] + 1} "
                     f"({first['error']['phase']}): {first['error']['message']}")
        lines += ["    " + line for line in first["error"]["traceback"]]
        if first["error"]["type"] in ("OutOfMemoryError", "MemoryError"):
            lines.append("out of memory: lower data.micro_batch_size, set parallel.activation_checkpointing = true, "
                         "use a sharded strategy (fsdp) or parallel.cpu_offload; see `disttrain estimate-memory`")
    if stuck:
        lines.append("stuck: " + ", ".join(f"rank {s['rank']} in {s['phase']} after step {s['step']}"
                                           for s in stuck) + "; other ranks were waiting for it")
        lines += dumped(run_dir, {r: o for r, o in (stacks or {}).items() if r in stuck_set}, statuses, "when stopped")
    if ended:
        lines.append("ended on another node first: " + ", ".join(f"rank {s['rank']} (node {s['node']}, {s['host']}) "
                                                                 f"{s['ended']}" for s in ended)
                     + "; this node's ranks were stopped, as they may have been waiting for it")
    lines.append(f"full per-rank logs: {Path(run_dir) / 'logs'}")
    return "\n".join(lines)


def dumped(run_dir: Path, stacks: dict[int, int], statuses: list[dict], when: str) -> list[str]:
    """The report of the ranks' answers to the last dump request (`ask_for_dumps`): the main-thread stacks dumped
    from each offset of `stacks` (rank -> where its answer starts in its stack file), then what every answering
    rank's flight recorder says (`waits`). A rank on another node is in it only where its own launcher asked it too."""
    folder, lines = status_dir(run_dir), []
    for rank, offset in sorted(stacks.items()):
        dump = folder / f"rank{rank}.stack"
        try:
            with open(dump, "rb") as f:
                f.seek(offset)
                frames = main_stack(f.read().decode(errors="replace"))
        except OSError:
            frames = []
        if frames:
            lines.append(f"rank {rank}'s stack {when} (most recent call first; every thread's: {dump}):")
            lines += ["    " + frame for frame in frames]
    asked, records = _mtime(folder / DUMP_REQUEST), {}
    for s in statuses:
        path = folder / f"rank{s['rank']}.collectives.json"
        if asked and _mtime(path) >= asked:  # answered this request
            try:
                records[s["rank"]] = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
    if records:
        lines.append(f"collectives (torch's flight recorder; every record: {folder / 'rank<R>.collectives.json'}):")
        lines += ["    " + line for line in waits(records)]
    return lines


def report(run_dir: Path, dump: bool = False) -> str:
    """`disttrain status RUN_DIR`: where each rank of a running (or ended) job is, from its status file; with `dump`,
    also the stacks and collectives of this machine's live ranks, asked for as the watchdog does (nothing is
    stopped)."""
    statuses = read_statuses(run_dir)
    if not statuses:
        from disttrain.errors import ConfigError

        raise ConfigError(f"{status_dir(run_dir)}: no rank status here; give the run folder of a job (the RUN_DIR that "
                        "`disttrain train` prints, or `disttrain launch --run-dir`)")
    now, host = time.time(), socket.gethostname()
    lines = [f"{len(statuses)} rank(s) in {run_dir} (last completed step, phase, for how long, last heartbeat):"]
    live = []  # this machine's ranks that are running now: their process is there and their heartbeat is fresh
    for s in statuses:
        gone = ""
        if s["host"] == host and s.get("phase") != "done":
            try:
                os.kill(s["pid"], 0)
                if now - s["heartbeat"] < LIVE_HEARTBEAT_S:
                    live.append(s)
            except ProcessLookupError:
                gone = ", process gone"
            except OSError:  # (another user's process under a reused pid)
                gone = ", process not this job's"
        state = ("raised " + s["error"]["type"] if "error" in s else s["ended"] if "ended" in s else "")
        lines.append(f"  rank {s['rank']} (node {s['node']}, {s['host']}, pid {s['pid']}): step {s['step']}, "
                     f"{s['phase']} for {now - s['since']:.0f} s, heartbeat {now - s['heartbeat']:.0f} s ago{gone}"
                     + (f": {state}" if state else ""))
    if dump and not live:
        lines.append(f"no live rank of this job on {host} to ask for its stack (run `disttrain status --dump` on the "
                     "node where they run)")
    elif dump:
        lines += dumped(run_dir, ask_for_dumps(run_dir, live), live, "now")
    return "\n".join(lines)


def ended_elsewhere(statuses: list[dict], host: str, before: set[tuple]) -> list[dict]:
    """Ranks on other hosts whose launcher gave up on them (`mark_ended`), except the processes already in the run
    folder when this watch began (`before`: `_process` of each; a previous run's statuses, marked or not)."""
    return [s for s in statuses if s["host"] != host and "ended" in s and s.get("phase") != "done"
            and _process(s) not in before]


def _process(status: dict) -> tuple:
    return status["rank"], status["host"], status["pid"]


def ask_for_dumps(run_dir: Path, statuses: list[dict], wait_s: float = 3.0) -> dict[int, int]:
    """Ask these ranks for their Python stacks (STACK_SIGNAL, to those that registered for it: not where the user has
    a handler of their own) and their flight-recorder records (DUMP_REQUEST, answered by the heartbeat thread within
    a beat), and wait (at most `wait_s`) for both. Returns, for each rank asked for its stack, where this request's
    dump starts in its stack file (the rank appends: nothing is emptied, so two requesters never erase each other's)."""
    folder = status_dir(run_dir)
    request = folder / DUMP_REQUEST
    try:
        request.touch()
    except OSError:  # (a full disk: the stacks may still come, and the job is stopped all the same)
        pass
    asked = _mtime(request)
    offsets, records = {}, [folder / f"rank{s['rank']}.collectives.json" for s in statuses]
    for s in statuses:
        if not s.get("stacks"):
            continue
        try:
            offset = (folder / f"rank{s['rank']}.stack").stat().st_size
            os.kill(s["pid"], STACK_SIGNAL)
            offsets[s["rank"]] = offset
        except OSError:  # (gone, or not ours: nothing to ask)
            pass

    def sizes() -> dict[int, int]:
        return {r: _mtime(folder / f"rank{r}.stack", "st_size") for r in offsets}

    # answered: every stack file grew, and stopped growing (a dump is written thread by thread: read too early, it
    # may hold the other threads and not yet the main one), and every rank's records are newer than the request
    deadline, before = time.monotonic() + wait_s, None
    while time.monotonic() < deadline:
        now = sizes()
        grown = all(now[r] > o for r, o in offsets.items())
        if grown and now == before and all(_mtime(p) >= asked for p in records):
            break
        before = now
        time.sleep(0.1)
    return offsets


class Watchdog:
    """Launcher thread: SIGKILL every worker of this node when a rank stops making progress, or when another node's
    launcher gave up on its ranks (`mark_ended`), after recording why."""

    def __init__(self, run_dir: Path, timeout_s: float, startup_timeout_s: float, poll_s: float = 1.0):
        self.run_dir, self.timeout_s, self.startup_timeout_s = run_dir, timeout_s, startup_timeout_s
        self.stuck: list[dict] = []
        self.ended: list[dict] = []  # other nodes' ranks whose launcher gave up, if that stopped this node's
        self._before: set[tuple] = set()  # the processes whose statuses were in the run folder when the watch began
        self.stacks: dict[int, int] = {}  # rank -> where its stack dump starts (`ask_for_dumps`), if it hung
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(poll_s,), name="disttrain-watchdog", daemon=True)

    def __enter__(self):
        self._before = {_process(s) for s in read_statuses(self.run_dir)}  # before this run's workers start
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _watch(self, poll_s: float) -> None:
        host = socket.gethostname()
        while not self._stop.wait(poll_s):
            statuses = read_statuses(self.run_dir)
            stuck = stuck_ranks(statuses, self.timeout_s, self.startup_timeout_s)
            ended = ended_elsewhere(statuses, host, self._before)
            if stuck:
                self.stuck = stuck
                why = (f"rank(s) {', '.join(str(s['rank']) for s in stuck)} made no progress for {self.timeout_s:g}s; "
                       "stopping the job")
            elif ended:
                self.ended = ended
                why = ("; ".join(f"rank {s['rank']} (node {s['node']}, {s['host']}) {s['ended']}" for s in ended)
                       + ", and its node's launcher gave up; stopping this node's ranks")
            else:
                continue
            print(f"disttrain: {why}", file=sys.stderr, flush=True)
            # each node's launcher stops its own workers, but not those that finished (they are closing down)
            local = [s for s in statuses if s["host"] == host and s.get("phase") != "done"]
            if stuck:
                self.stacks = ask_for_dumps(self.run_dir, local)
            for s in local:
                try:
                    os.kill(s["pid"], signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return
