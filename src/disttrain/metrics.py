"""Metric sinks: `metrics.jsonl` always, a progress line on the terminal, TensorBoard optionally.

Only rank 0 writes; other ranks get `NullMetrics`, so the loop never branches on the rank.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from disttrain.config import LogConfig
from disttrain.perf import straggler


class NullMetrics:
    def log(self, step: int, values: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class ProgressBar:
    """`[####......] 40/100 loss 2.310 | 51.2k tok/s | MFU 41% | comm 3% | eta 12s` redrawn in place on a terminal;
    on a pipe (CI, log files) the same text as a new line about 20 times per run. A rank slower than rank 0 by more
    than 20% is named (`slowest rank 3 1.4x`)."""

    def __init__(self, total: int, stream: TextIO = sys.stderr, start_step: int = 0):
        self.total, self.stream, self.start_step = total, stream, start_step
        self.tty = stream.isatty()
        self.every = max(1, total // 20)
        self.start = time.perf_counter()

    def update(self, step: int, values: dict[str, Any]) -> None:
        if not self.tty and step % self.every and step != self.total:
            return
        done = int(30 * step / self.total)
        elapsed = time.perf_counter() - self.start
        done_here = step - self.start_step
        eta = elapsed / done_here * (self.total - step) if done_here > 0 else 0.0
        parts = [f"[{'#' * done}{'.' * (30 - done)}] {step}/{self.total}"]
        if "loss" in values:
            parts.append(f"loss {values['loss']:.4f}")
        if "tokens_per_s" in values:
            parts.append(f"{values['tokens_per_s'] / 1000:.1f}k tok/s")
        if values.get("mfu") is not None:
            parts.append(f"MFU {values['mfu']:.0%}")
        if values.get("comm_exposed_s") is not None and values.get("step_time_s"):
            parts.append(f"comm {values['comm_exposed_s'] / values['step_time_s']:.0%}")
        if straggler(values):
            parts.append("slowest " + straggler(values))
        if "eval_loss" in values:
            parts.append(f"eval {values['eval_loss']:.4f}")
        parts.append(f"eta {eta:.0f}s")
        line = " | ".join(parts)
        self.stream.write(("\r" + line + "\x1b[K") if self.tty else line + "\n")
        if self.tty and step == self.total:
            self.stream.write("\n")
        self.stream.flush()


class Metrics:
    """Rank 0's sinks. `log` takes a step and any scalar values; every call appends one JSON line."""

    def __init__(self, run_dir: Path, cfg: LogConfig, total_steps: int, start_step: int = 0):
        """`start_step > 0` (a resumed run): keep the lines up to that step, drop later ones (they belong
        to the interrupted run after its checkpoint), and append."""
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        if start_step > 0 and self.path.exists():
            kept = [line for line in self.path.read_text().splitlines(keepends=True)
                    if line.strip() and json.loads(line)["step"] <= start_step]
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(kept))
            tmp.replace(self.path)
            self.file = self.path.open("a")
        else:
            self.file = self.path.open("w")
        self.progress = ProgressBar(total_steps, start_step=start_step) if cfg.progress else None
        self.tensorboard = None
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(str(run_dir / "tensorboard"))

    def log(self, step: int, values: dict[str, Any]) -> None:
        record = {"step": step, **{k: _jsonable(v) for k, v in values.items()}}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.progress is not None:
            self.progress.update(step, values)
        if self.tensorboard is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)):
                    self.tensorboard.add_scalar(key, value, step)

    def close(self) -> None:
        self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep the line parseable by strict readers
    return value
