"""Benchmarks: programs that print and save their figures (`disttrain bench NAME`)."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path


def worker_entry(module: str, args: argparse.Namespace) -> list[str]:
    """The `disttrain launch` entry that reruns benchmark `module` as a worker on every rank, with the same
    arguments (`--out` made absolute)."""
    values = {**vars(args), "out": Path(args.out).resolve()}
    return [module, "--worker", *[f"--{k.replace('_', '-')}={v}" for k, v in values.items() if k != "worker"]]


def launch_workers(args: argparse.Namespace, name: str) -> tuple[int, Path]:
    """Rerun benchmark `disttrain.bench.<name>` as a worker on `args.nproc` ranks (torchrun, run folder
    `<out>/<name>_run`): (its exit code, the absolute output folder)."""
    from disttrain.errors import make_folder
    from disttrain.launch import launch

    out = make_folder(Path(args.out).resolve(), "--out")
    return launch(args.nproc, worker_entry(f"disttrain.bench.{name}", args), out / f"{name}_run"), out


def check_numbers(*checks: tuple[str, float, float]) -> None:
    """Each (flag, value, lowest allowed): a finite number >= the lowest, else one line naming the flag (before a
    benchmark writes or launches anything)."""
    from disttrain.errors import ConfigError

    for flag, value, low in checks:
        if not (math.isfinite(value) and value >= low):
            raise ConfigError(f"{flag} {value:g}: must be >= {low:g}")


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


def other_cpu(busy: float, own_all_ranks: float, wall: float) -> float:
    """Cores other processes kept busy over `wall` seconds: the machine's busy time less this job's ranks' own.
    A benchmark on a shared machine reports it, so that a figure measured next to a neighbour's job is seen as such."""
    return max(0.0, (busy - own_all_ranks) / wall)
