"""The launcher's side of "who is doing what" (monitor.py keeps the ranks' status files): its watchdog, which stops a
job whose rank has made no progress for `dist.timeout_s` (or whose rank on another node ended), asking the stuck
ranks for their stacks first, and the failure summary that names each rank's end, the first exception, the stacks
and the collectives each rank waits in. Never imports torch: the launcher runs it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from disttrain.monitor import (
    DUMP_REQUEST,
    LIVE_HEARTBEAT_S,
    STACK_SIGNAL,
    UNTIMED_PHASES,
    limit,
    main_stack,
    mtime,
    read_statuses,
    status_dir,
    the_waited_for,
    waits,
)


def stuck_ranks(statuses: list[dict], timeout_s: float, startup_timeout_s: float, now: float | None = None
                ) -> list[dict]:
    """Ranks that have made no progress for longer than their limit: the one their status carries (its job's
    `dist.timeout_s` / `dist.startup_timeout_s`: a launched script's own), else the launcher's. While one rank hangs,
    its peers wait for it inside a collective, so only the rank(s) they wait for are named (`the_waited_for`)."""
    now = time.time() if now is None else now
    live = [s for s in statuses if s["phase"] not in UNTIMED_PHASES and "error" not in s]
    over = [s for s in live if now - s["since"] > limit(s, timeout_s, startup_timeout_s)]
    return the_waited_for(over, live, lambda s: s["since"], lambda s: s.get("in_collective", False)) if over else []


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
    asked, records = mtime(folder / DUMP_REQUEST), {}
    for s in statuses:
        path = folder / f"rank{s['rank']}.collectives.json"
        if asked and mtime(path) >= asked:  # answered this request
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
    asked = mtime(request)
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
        return {r: mtime(folder / f"rank{r}.stack", "st_size") for r in offsets}

    # answered: every stack file grew, and stopped growing (a dump is written thread by thread: read too early, it
    # may hold the other threads and not yet the main one), and every rank's records are newer than the request
    deadline, before = time.monotonic() + wait_s, None
    while time.monotonic() < deadline:
        now = sizes()
        grown = all(now[r] > o for r, o in offsets.items())
        if grown and now == before and all(mtime(p) >= asked for p in records):
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
                waited = limit(stuck[0], self.timeout_s, self.startup_timeout_s)
                why = (f"rank(s) {', '.join(str(s['rank']) for s in stuck)} made no progress for {waited:g}s; "
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
