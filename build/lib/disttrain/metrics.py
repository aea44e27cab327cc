"""Metric sinks: `metrics.jsonl` always, a progress line on the terminal, TensorBoard optionally.

Only rank 0 writes; other ranks get `NullMetrics`, so the loop never branches on the rank.
"""

from __future__ import annotations

import json
import math
import os
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
    """`[####......] 40/100 loss 2.310 | 51.2k tok/s | MFU 41% | comm 3% | eta 0:00:12` redrawn in place on a terminal;
    on a pipe (CI, log files) the same text as a new line about 20 times per run, or at each logged step where there
    are fewer (at the first logged step a twentieth of the run after the previous line, and at the last). A rank whose
    work per step is at least 1.2 x the median of the others' is named (`slowest rank 3 1.4x`; perf.rank_summary)."""

    def __init__(self, total: int, stream: TextIO = sys.stderr, start_step: int = 0):
        self.total, self.stream, self.start_step = total, stream, start_step
        self.tty = stream.isatty()
        self.every = max(1, total // 20)
        self.start = time.perf_counter()
        self.printed = start_step  # the step of the last line on a pipe

    def restart(self, start_step: int) -> None:
        """Count the rate (and the ETA) from now, at `start_step`."""
        self.start_step, self.start = start_step, time.perf_counter()

    def render(self, step: int, values: dict[str, Any]) -> str:
        """The bar's text at `step`."""
        done = int(30 * min(step, self.total) / self.total)
        elapsed = time.perf_counter() - self.start
        done_here = step - self.start_step
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
        if done_here > 0:  # (no rate yet at the first line it counts from)
            parts.append(f"eta {hms(elapsed / done_here * max(self.total - step, 0))}")
        return " | ".join(parts)

    def update(self, step: int, values: dict[str, Any]) -> None:
        if not self.tty and step < self.printed + self.every and step != self.total:
            return  # (not `step % every`: the logged steps, every train.log_every, may never be multiples of it)
        self.printed = step
        line = self.render(step, values)
        self.stream.write(("\r" + line + "\x1b[K") if self.tty else line + "\n")
        if self.tty and step == self.total:
            self.stream.write("\n")
        self.stream.flush()


def hms(seconds: float) -> str:
    """h:mm:ss"""
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Metrics:
    """Rank 0's sinks. `log` takes a step and any scalar values; every call appends one JSON line."""

    def __init__(self, run_dir: Path, cfg: LogConfig, total_steps: int, start_step: int = 0,
                 params: dict[str, Any] | None = None):
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
        draws = os.environ.get("DISTTRAIN_LAUNCHER_DRAWS") == "1"  # the launcher draws it (console.py)
        self.progress = ProgressBar(total_steps, start_step=start_step) if cfg.progress and not draws else None
        self.tensorboard = None
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(str(run_dir / "tensorboard"))
        self.trackers = []  # experiment trackers: log(step, scalars), close()
        if cfg.wandb:
            self.trackers.append(WandbSink(run_dir, cfg.wandb_project, params or {}, resumed=start_step > 0))
        if cfg.mlflow:
            self.trackers.append(MlflowSink(run_dir, cfg.mlflow_uri, params or {}))

    def log(self, step: int, values: dict[str, Any]) -> None:
        record = {"step": step, **{k: _jsonable(v) for k, v in values.items()}}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.progress is not None:
            self.progress.update(step, values)
        scalars = {k: float(v) for k, v in values.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        if self.tensorboard is not None:
            for key, value in scalars.items():
                self.tensorboard.add_scalar(key, value, step)
        for tracker in self.trackers:
            tracker.log(step, scalars)

    def close(self) -> None:
        self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        for tracker in self.trackers:
            tracker.close()


class WandbSink:
    """Weights & Biases: one run per disttrain run (its name, the config as parameters), the scalars of every line."""

    def __init__(self, run_dir: Path, project: str, params: dict[str, Any], resumed: bool):
        import hashlib

        import wandb

        where = hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:8]  # a resumed run continues its own
        self.run = wandb.init(project=project, name=run_dir.name, dir=str(run_dir), config=params,
                              id=f"{run_dir.name}-{where}", resume="allow" if resumed else None)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowSink:
    """MLflow: a run named after the disttrain run, in `uri` (default: a file store in RUN_DIR/mlruns)."""

    def __init__(self, run_dir: Path, uri: str, params: dict[str, Any]):
        import mlflow

        self.mlflow = mlflow
        if not uri:  # the local file store, which MLflow 3 keeps in maintenance mode behind this switch
            import os

            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        mlflow.set_tracking_uri(uri or (run_dir / "mlruns").resolve().as_uri())
        mlflow.set_experiment("disttrain")
        self.run = mlflow.start_run(run_name=run_dir.name)
        flat = {k: v for k, v in params.items() if isinstance(v, (str, int, float, bool))}
        for start in range(0, len(flat), 100):  # MLflow takes at most 100 parameters per call
            mlflow.log_params(dict(list(flat.items())[start:start + 100]))

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.mlflow.log_metrics(scalars, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep the line parseable by strict readers
    return value
