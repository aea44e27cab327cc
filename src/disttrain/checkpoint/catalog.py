"""The committed checkpoints of one folder: found by scanning for commit markers (never from `latest` alone), their
manifests, the best by a metric, and rotation (keep the newest and the best; remove uncommitted leftovers)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from disttrain.checkpoint.commit import remove_checkpoint
from disttrain.checkpoint.layout import MANIFEST, is_committed, parse_step, step_dir_name
from disttrain.config import CheckpointConfig


class Catalog:
    """list / latest / best / manifest of one checkpoint folder, and its rotation: what needs no process group.
    `CheckpointManager` is a catalog that also saves and loads."""

    def __init__(self, directory: str | Path, cfg: CheckpointConfig | None = None):
        self.dir = Path(directory)
        self.cfg = cfg or CheckpointConfig()

    def list(self) -> list[int]:
        """Steps of committed checkpoints, oldest first (found by scanning, not from `latest`)."""
        if not self.dir.is_dir():
            return []
        steps = [parse_step(p) for p in self.dir.iterdir() if p.is_dir() and is_committed(p)]
        return sorted(s for s in steps if s is not None)

    def latest(self) -> int | None:
        steps = self.list()
        return steps[-1] if steps else None

    def path(self, step: int) -> Path:
        return self.dir / step_dir_name(step)

    def manifest(self, step: int) -> dict[str, Any]:
        return json.loads((self.path(step) / MANIFEST).read_text())

    def best(self) -> int | None:
        """Best committed checkpoint by `best_metric` (`best_mode` min/max); NaN or missing is never best;
        ties go to the earlier step."""
        ranked = self._ranked_by_metric()
        return ranked[0] if ranked else None

    def _metrics(self) -> list[tuple[int, dict[str, Any]]]:
        """(step, recorded metrics) of every committed checkpoint, oldest first; a damaged manifest is left out (never
        best: `ckpt verify` says why)."""
        out = []
        for step in self.list():
            try:
                metrics = self.manifest(step).get("metrics", {})
            except (OSError, ValueError, AttributeError):
                continue
            out.append((step, metrics if isinstance(metrics, dict) else {}))
        return out

    def _flagged_best(self) -> list[int]:
        """Steps saved with `is_best=True`, oldest first."""
        return [step for step, metrics in self._metrics() if metrics.get("is_best")]

    def _ranked_by_metric(self) -> list[int]:
        sign = 1.0 if self.cfg.best_mode == "min" else -1.0
        scored = [(sign * value, step) for step, metrics in self._metrics()
                  if isinstance(value := metrics.get(self.cfg.best_metric), (int, float)) and math.isfinite(value)]
        return [step for _, step in sorted(scored)]

    def _rotate(self, keep: int) -> None:
        """Keep the newest `keep_last` plus the best `keep_best`; never the newest committed one;
        remove uncommitted leftovers."""
        steps = self.list()
        keep_set = set(steps[-max(self.cfg.keep_last, 1):]) | {keep}
        if self.cfg.keep_best > 0:
            keep_set |= set(self._ranked_by_metric()[: self.cfg.keep_best])
            keep_set |= set(self._flagged_best()[-1:])  # the newest saved with is_best=True
        for child in self.dir.iterdir():
            step = parse_step(child)
            if step is None or not child.is_dir():
                continue
            if (is_committed(child) and step not in keep_set) or (not is_committed(child) and step != keep):
                remove_checkpoint(child)
