"""Benchmarks: programs that print and save their figures (`disttrain bench NAME`)."""

from __future__ import annotations

import argparse
from pathlib import Path


def worker_entry(module: str, args: argparse.Namespace) -> list[str]:
    """The `disttrain launch` entry that reruns benchmark `module` as a worker on every rank, with the same
    arguments (`--out` made absolute)."""
    values = {**vars(args), "out": Path(args.out).resolve()}
    return [module, "--worker", *[f"--{k.replace('_', '-')}={v}" for k, v in values.items() if k != "worker"]]
