"""Benchmarks: programs that print and save their figures (`disttrain bench NAME`)."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path


def worker_entry(module: str, args: argparse.Namespace) -> list[str]:
    """The `disttrain launch` entry that reruns benchmark `module` as a worker on every rank, with the same
    arguments (`--out` made absolute; a repeatable flag's list once per item, under its `dest`)."""
    values = {**vars(args), "out": Path(args.out).resolve()}
    flags = [(k, item) for k, v in values.items() if k != "worker" for item in (v if isinstance(v, list) else [v])]
    return [module, "--worker", *[f"--{k.replace('_', '-')}={v}" for k, v in flags]]


def launch_workers(args: argparse.Namespace, name: str) -> tuple[int, Path]:
    """Rerun benchmark `disttrain.bench.<name>` as a worker on `args.nproc` ranks (torchrun, run folder
    `<out>/<name>_run`): (its exit code, the absolute output folder)."""
    from disttrain.errors import make_folder
    from disttrain.launch import launch

    out = make_folder(Path(args.out).resolve(), "--out")
    return launch(args.nproc, worker_entry(f"disttrain.bench.{name}", args), out / f"{name}_run"), out


def check_numbers(*checks: tuple) -> None:
    """Each (flag, value, lowest allowed[, what to give[, highest allowed]]): a finite number in range, else one line
    naming the flag and `what` (before a benchmark writes or launches anything)."""
    from disttrain.errors import ConfigError

    for flag, value, low, *rest in checks:
        what, high = (rest[0] if rest else None), (rest[1] if len(rest) > 1 else math.inf)
        if not (math.isfinite(value) and low <= value <= high):
            bound = f"must be >= {low:g}" if high == math.inf else f"must be in {low:g}..{high:g}"
            raise ConfigError(f"{flag} {value:g}: " + (f"give {what}" if what else bound))


def integers(text: str, flag: str, what: str, example: str, low: int = 1, high: float = math.inf) -> list[int]:
    """The distinct integers of a comma-separated flag, sorted; one line naming the flag and what to give (e.g.
    "counts >= 1") where one is not an integer, none is given, or one lies outside low..high."""
    from disttrain.errors import ConfigError

    try:
        values = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        values = []
    if not values or values[0] < low or values[-1] > high:
        raise ConfigError(f"{flag} {text!r}: give {what} separated by commas, e.g. {flag} {example}")
    return values


def rank_limit(gpus: int) -> tuple[int, str]:
    """(the most ranks a benchmark starts on this machine, what bounds it): one per visible GPU where `gpus` run the
    ranks, else 4 per core (more would measure the scheduler, not the job)."""
    if gpus:
        return gpus, f"{gpus} visible GPU(s), one rank each"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return 4 * cores, f"{cores} core(s), at most 4 ranks per core"


def busy_seconds() -> float:
    """CPU seconds the whole machine has been busy, all cores (Linux: /proc/stat; idle and iowait aside)."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def own_seconds() -> float:
    """CPU seconds of this process, all its threads."""
    t = os.times()
    return t.user + t.system


def backend_threads_seconds() -> float | None:
    """CPU seconds of this process's threads that Python did not start: a process group's own (gloo's workers and
    its loop), from Linux's per-thread scheduler statistics (nanoseconds); None where none can be read (or there are
    none)."""
    import threading

    ours = {t.native_id for t in threading.enumerate()}
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return None
    total, read = 0, False
    for tid in tids:
        if tid in ours:
            continue
        try:
            total += int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0])
            read = True
        except (OSError, ValueError, IndexError):  # (a thread that ended meanwhile; no schedstat in this kernel)
            continue
    return total / 1e9 if read else None


def other_cpu(busy: float, own_all_ranks: float, wall: float) -> float:
    """Cores other processes kept busy over `wall` seconds: the machine's busy time less this job's ranks' own.
    A benchmark on a shared machine reports it, so that a figure measured next to a neighbour's job is seen as such."""
    return max(0.0, (busy - own_all_ranks) / wall)
