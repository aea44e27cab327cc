"""The Trainer: a thin loop over the TrainingBackend.

    for each step: fetch this rank's micro-batches -> forward_backward each -> optim_step -> eval/log

The same loop runs in one process (`disttrain train`), under torchrun (`disttrain train --nproc N`) and
for your own model, data and loss (`Trainer(config, model=..., train_dataset=..., loss_fn=...)`).
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from disttrain.backend import LossFn, TrainingBackend, create_backend
from disttrain.config import Config, resolve_strategy, save_config, validate
from disttrain.data import GlobalSampler, build_datasets, eval_shard, fetch, split_micro
from disttrain.metrics import Metrics, NullMetrics
from disttrain.models import build_model
from disttrain.optim import OptimizerFactory, optimizer_factory, scheduler_factory
from disttrain.runtime import Runtime, init_runtime, shutdown

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    """Global mean training loss of every step."""
    eval_losses: dict[int, float] = field(default_factory=dict)
    """Validation loss by step."""


class Trainer:
    """Train `config`'s job, or your own model / datasets / loss with the same loop and launcher.

    model:          any nn.Module (default: built from `model.name`).
    train_dataset:  any map-style Dataset (default: from `data.source`); items are dicts with
                    `input_ids`/`labels` (padded with -100) or tuples `(input, target, ...)`.
    eval_dataset:   validated every `train.eval_every` steps, each sample counted exactly once.
    loss_fn:        `loss_fn(outputs, batch)` -> mean loss, or (summed loss, item count); default:
                    next-token cross-entropy.
    """

    def __init__(self, config: Config, *, model: nn.Module | None = None, train_dataset: Dataset | None = None,
                 eval_dataset: Dataset | None = None, loss_fn: LossFn | None = None,
                 optimizer_factory: OptimizerFactory | None = None, runtime: Runtime | None = None):
        self.cfg = config
        self.model, self.train_dataset, self.eval_dataset = model, train_dataset, eval_dataset
        self.loss_fn, self.optimizer_factory, self.runtime = loss_fn, optimizer_factory, runtime

    def fit(self) -> TrainResult:
        owns_runtime = self.runtime is None
        runtime = self.runtime or init_runtime(self.cfg.dist)
        try:
            return self._fit(runtime)
        finally:
            if owns_runtime:
                shutdown(runtime)

    def _setup(self, runtime: Runtime) -> tuple[TrainingBackend, Dataset, Dataset | None]:
        cfg = self.cfg
        validate(cfg, gpu_count=torch.cuda.device_count(), world=runtime.world_size)
        seed_everything(cfg.run.seed)
        train, val = self.train_dataset, self.eval_dataset
        if train is None:
            train, built_val = build_datasets(cfg.data, cfg.model.seq_len)
            val = built_val if val is None else val
        model = self.model if self.model is not None else build_model(cfg.model)
        backend = create_backend(
            model, self.optimizer_factory or optimizer_factory(cfg.optim),
            strategy=resolve_strategy(cfg, runtime.world_size), precision=cfg.parallel.precision,
            runtime=runtime, parallel=cfg.parallel, scheduler_factory=scheduler_factory(cfg.optim, cfg.train.steps),
            grad_clip=cfg.optim.grad_clip, loss_fn=self.loss_fn,
        )
        return backend, train, val

    def _fit(self, runtime: Runtime) -> TrainResult:
        cfg = self.cfg
        backend, train, val = self._setup(runtime)
        sampler = GlobalSampler(len(train), cfg.run.seed, cfg.data.shuffle)
        metrics = Metrics(cfg.run_dir, cfg.log, cfg.train.steps) if runtime.is_main_process() else NullMetrics()
        if runtime.is_main_process():
            save_config(cfg, cfg.run_dir / "config.toml")
        result, cursor = TrainResult(), 0
        try:
            for step in range(1, cfg.train.steps + 1):
                values = self._train_step(backend, train, sampler, cursor, runtime)
                cursor += cfg.data.global_batch_size
                result.losses.append(values["loss"])
                if val is not None and cfg.train.eval_every and (step % cfg.train.eval_every == 0
                                                                 or step == cfg.train.steps):
                    values["eval_loss"], _ = evaluate(backend, val, runtime, cfg.data.micro_batch_size,
                                                      cfg.train.eval_samples)
                    result.eval_losses[step] = values["eval_loss"]
                if step % cfg.train.log_every == 0 or step == cfg.train.steps or "eval_loss" in values:
                    metrics.log(step, values)
        finally:
            metrics.close()
        return result

    def _train_step(self, backend: TrainingBackend, train: Dataset, sampler: GlobalSampler, cursor: int,
                    runtime: Runtime) -> dict[str, Any]:
        start = time.perf_counter()
        d = self.cfg.data
        indices = sampler.rank_indices(cursor, d.global_batch_size, runtime.world_size, runtime.rank)
        micro = split_micro(indices, d.micro_batch_size)
        for i, batch_indices in enumerate(micro):
            backend.forward_backward(fetch(train, batch_indices), sync=i == len(micro) - 1)
        out = backend.optim_step()
        elapsed = time.perf_counter() - start
        return {"loss": out["loss"], "lr": out["lr"], "grad_norm": out["grad_norm"], "tokens": int(out["count"]),
                "tokens_per_s": out["count"] / elapsed, "step_time_s": elapsed}


def evaluate(backend: TrainingBackend, dataset: Dataset, runtime: Runtime, micro_batch_size: int,
             limit: int = 0) -> tuple[float, int]:
    """(mean loss, items counted) over the first `limit` samples (0 = all), each sample counted exactly
    once across ranks.

    Ranks get contiguous shards whose sizes differ by at most one; every rank runs the same number of
    forward passes (a rank with a shorter shard repeats a batch and discards it), so strategies whose
    forward communicates never wait on a rank that has finished.
    """
    n = min(len(dataset), limit) if limit else len(dataset)
    shard = eval_shard(n, runtime.world_size, runtime.rank)
    batches = split_micro(shard, micro_batch_size)
    rounds = math.ceil(math.ceil(n / runtime.world_size) / micro_batch_size)
    totals = torch.zeros(2, dtype=torch.float64, device=runtime.device)
    for i in range(rounds):
        counted = i < len(batches)
        batch = fetch(dataset, batches[i] if counted else [0])
        outputs = backend.forward(batch)
        if counted:
            loss_sum, count = backend.loss_terms(outputs, batch)
            totals += torch.stack([loss_sum.detach().double(), count])
    if runtime.distributed:
        dist.all_reduce(totals)
    loss_sum, count = totals.tolist()
    return (loss_sum / count if count > 0 else float("nan")), int(count)
