"""The Trainer: a thin loop over the TrainingBackend.

    for each step: fetch this rank's micro-batches -> forward_backward each -> optim_step -> eval/log

The same loop runs in one process (`disttrain train`), under torchrun (`disttrain train --nproc N`) and
for your own model, data and loss (`Trainer(config, model=..., train_dataset=..., loss_fn=...)`).
"""

from __future__ import annotations

import logging
import math
import os
import random
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from disttrain.backend import LossFn, TrainingBackend, create_backend
from disttrain.checkpoint import ArrivalError, CheckpointError, CheckpointManager, parse_step, restore_rng
from disttrain.config import Config, ConfigError, profile_range, save_config, validate
from disttrain.data import GlobalSampler, build_datasets, collate, eval_shard, fetch, split_micro
from disttrain.loader import CollateFn, Loaders, StepBatches, check_dataset, probe
from disttrain.metrics import Metrics, NullMetrics
from disttrain.models import build_model, freeze
from disttrain.models.hf import is_hf_model
from disttrain.monitor import RankStatus, peer_failed
from disttrain.optim import OptimizerFactory, optimizer_factory, scheduler_factory
from disttrain.parallel import registry
from disttrain.perf import StepMeter, StepProfiler, flops_per_token, rank_summary, straggler
from disttrain.runtime import Runtime, check_ranks_agree, detect_launch, init_runtime, shutdown
from disttrain.signals import Preempted, StopSignals

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
    grad_norms: list[float] = field(default_factory=list)
    """Global gradient norm of every step (of the token-mean gradient, before clipping)."""
    lines: int = 0
    """Lines logged (each gathers the ranks' figures)."""
    stragglers: dict[int, list[float]] = field(default_factory=dict)
    """By rank, its `slowest_ratio` on each line that named it a straggler (perf.straggler)."""


class Trainer:
    """Train `config`'s job, or your own model / datasets / loss with the same loop and launcher.

    model:          any nn.Module (default: built from `model.name`).
    train_dataset:  any map-style Dataset (len() and [index]; a Hugging Face `datasets.Dataset` too) (default:
                    from `data.source`); items are dicts with `input_ids`/`labels` (padded with -100) or tuples
                    `(input, target, ...)`. Iterable and streaming datasets are refused: exact resume needs an index.
    eval_dataset:   validated every `train.eval_every` steps, each sample counted exactly once.
    collate_fn:     `collate_fn(items) -> batch`, used for training and evaluation batches, in the DataLoader's
                    workers when `data.num_workers > 0` (default: `disttrain.data.collate`, which pads).
    loss_fn:        `loss_fn(outputs, batch)` -> mean loss, or (summed loss, item count); default:
                    next-token cross-entropy, in HF's label convention for a transformers model (labels aligned
                    with input_ids, shifted by the loss) and with pre-shifted labels otherwise (losses.py).
    optimizer_factory: `factory(model) -> Optimizer`, your own optimizer; its learning rate is used as it is
                    unless `optim.schedule` asks for a schedule (default: disttrain's AdamW, warmup + cosine).
    """

    def __init__(self, config: Config, *, model: nn.Module | None = None, train_dataset: Dataset | None = None,
                 eval_dataset: Dataset | None = None, loss_fn: LossFn | None = None,
                 optimizer_factory: OptimizerFactory | None = None, runtime: Runtime | None = None,
                 collate_fn: CollateFn | None = None):
        self.cfg = config
        self.collate_fn = collate_fn or collate
        for dataset, name in ((train_dataset, "train_dataset"), (eval_dataset, "eval_dataset")):
            if dataset is not None:  # refused before anything starts or is written
                check_dataset(dataset, name)
                self._probe(dataset)
        self.model, self.train_dataset, self.eval_dataset = model, train_dataset, eval_dataset
        self.loss_fn, self.optimizer_factory, self.runtime = loss_fn, optimizer_factory, runtime
        self.backend: TrainingBackend | None = None
        """The backend of the latest `fit` (e.g. `backend.state_dict()` for the trained weights, on every
        rank while the process group is up)."""

    def fit(self) -> TrainResult:
        owns_runtime = self.runtime is None
        world = detect_launch(os.environ).world_size
        spec = registry.resolve(self.cfg.parallel.strategy, world)
        runtime = self.runtime or init_runtime(self.cfg.dist, always_form_group=spec.needs_group)
        limits = self.cfg.dist.timeout_s, self.cfg.dist.startup_timeout_s  # the watchdog's, for this job
        status = RankStatus(self.cfg.run_dir, runtime.rank, runtime.node_rank, limits=limits)
        clean = False
        try:
            with StopSignals(self.cfg.dist.shutdown_grace_s) as stop:
                result = self._fit(runtime, status, stop)
            status.close()
            clean = True
            return result
        except BaseException as exc:
            status.error(exc)
            status.close(phase=None)
            raise
        finally:
            if owns_runtime:
                shutdown(runtime, drain=clean)

    def _probe(self, dataset: Dataset) -> None:
        """Collate the stream's first micro-batch here, so that bad items are refused before any worker starts."""
        if len(dataset):
            sampler = GlobalSampler(len(dataset), self.cfg.run.seed, self.cfg.data.shuffle)
            probe(dataset, sampler.global_indices(0, self.cfg.data.micro_batch_size), self.collate_fn)

    def _setup(self, runtime: Runtime) -> tuple[TrainingBackend, Dataset, Dataset | None]:
        cfg = self.cfg
        validate(cfg, gpu_count=torch.cuda.device_count(), world=runtime.world_size)
        seed_everything(cfg.run.seed)
        model = freeze(self.model, cfg.model.freeze) if self.model is not None else build_model(cfg.model)
        train, val = self.train_dataset, self.eval_dataset
        if train is None:
            if cfg.data.tokenizer:
                from disttrain.corpus import check_source

                check_source(cfg.data.source, cfg.data.tokenizer, cfg.data.text_field, model_vocab_size(model, cfg))
            # HF models get windows in HF's label convention (losses.py)
            train, built_val = build_datasets(cfg.data, cfg.model.seq_len, aligned=is_hf_model(model))
            val = built_val if val is None else val
            self._probe(train)
        flops = flops_per_token(model, cfg.model.seq_len)  # the whole model's, before a pipeline keeps a stage of it
        backend = create_backend(
            model, self.optimizer_factory or optimizer_factory(cfg.optim), cfg.parallel,
            runtime=runtime,
            scheduler_factory=scheduler_factory(cfg.optim, cfg.train.steps, self.optimizer_factory is not None),
            grad_clip=cfg.optim.grad_clip, loss_fn=self.loss_fn, on_nonfinite=cfg.train.on_nonfinite,
            max_consecutive_skips=cfg.train.max_consecutive_skips,
        )
        self.meter = StepMeter(flops, runtime.world_size, runtime.device, cfg.parallel.precision, cfg.log.peak_tflops,
                               backend.prepared.comm)
        return backend, train, val

    def _fit(self, runtime: Runtime, status: RankStatus, stop: StopSignals) -> TrainResult:
        cfg = self.cfg
        backend, train, val = self._setup(runtime)
        self.backend = backend
        backend.on_phase = status.phase
        stop.on_signal = backend.request_stop
        stop.peer_failed = lambda: peer_failed(status.run_dir, runtime.rank, status.state["attempt"])
        check_ranks_agree(cfg, runtime, {"training samples": len(train),
                                         "evaluation samples": -1 if val is None else len(val)})
        sampler = GlobalSampler(len(train), cfg.run.seed, cfg.data.shuffle)
        manager = CheckpointManager(cfg.run_dir / "checkpoints", cfg.checkpoint, runtime,
                                    info={"strategy": backend.strategy,
                                          "config_hash": cfg.hash()}, timeout_s=cfg.dist.timeout_s)
        backend.before_update = manager.wait_for_copy
        start, cursor = self._resume(manager, backend, runtime)
        status.phase("data", step=start)
        d = cfg.data
        steps = StepBatches(sampler, cursor, max(0, (cfg.train.stop_at or cfg.train.steps) - start),
                            d.global_batch_size, d.micro_batch_size, *backend.data_parallel)
        metrics = Metrics(cfg.run_dir, cfg.log, cfg.train.stop_at or cfg.train.steps, start,
                          params=_flat_config(cfg)) if runtime.is_main_process() else NullMetrics()
        if runtime.is_main_process():
            save_config(cfg, cfg.run_dir / "config.toml")
        try:
            with Loaders(d, self.collate_fn, runtime.device, cfg.run.seed) as loaders:
                return self._loop(backend, loaders.train(train, steps), val, loaders, manager, metrics, status,
                                  start, cursor, runtime)
        finally:
            metrics.close()

    def _loop(self, backend, batches, val, loaders, manager, metrics, status, start, cursor, runtime) -> TrainResult:
        cfg, result = self.cfg, TrainResult()
        last = cfg.train.stop_at or cfg.train.steps
        d = cfg.data
        micro_per_step = -(-d.global_batch_size // backend.data_parallel[0] // d.micro_batch_size)
        began = time.perf_counter()
        with StepProfiler(profile_range(cfg.log.profile_steps), cfg.run_dir, runtime.rank, runtime.device) as profiler:
            for step in range(start + 1, last + 1):
                with profiler.step(step):
                    values = self._train_step(backend, batches, micro_per_step)
                cursor += d.global_batch_size
                self._after_step(step, last, values, result, backend, val, loaders, manager, metrics, status,
                                 runtime, cursor)
        self._checkpoint_guard(manager.wait_all)  # an async save's error surfaces at the latest here, on every rank
        if runtime.is_main_process() and last > start:
            log.info("%s", run_summary(cfg, start, last, time.perf_counter() - began, result, manager))
        return result

    def _after_step(self, step, last, values, result, backend, val, loaders, manager, metrics, status, runtime,
                    cursor) -> None:
        """Record the step; evaluate, log and checkpoint where due; raise Preempted when a stop was requested."""
        cfg = self.cfg
        result.losses.append(values["loss"])
        result.grad_norms.append(values["grad_norm"])
        stopping = values.pop("stop_requested")
        if val is not None and cfg.train.eval_every and (step % cfg.train.eval_every == 0 or step == last):
            status.phase("eval")
            values["eval_loss"], _ = evaluate(backend, val, runtime, cfg.data.micro_batch_size,
                                              cfg.train.eval_samples, batches_of=lambda b: loaders.eval(val, b))
            result.eval_losses[step] = values["eval_loss"]
        if step % cfg.train.log_every == 0 or step == last or "eval_loss" in values or stopping:
            self._line_figures(values, runtime)
            result.lines += 1
            if straggler(values):
                result.stragglers.setdefault(values["slowest_rank"], []).append(values["slowest_ratio"])
            metrics.log(step, values)
        if cfg.checkpoint.every and (step % cfg.checkpoint.every == 0 or step == last or stopping):
            status.phase("checkpoint")
            self._save(manager, backend, step, cursor, values)
        status.phase("data", step=step)
        if stopping:  # every rank saw the request at this same step (it rode on the step's all-reduce)
            self._checkpoint_guard(manager.wait_all)
            raise Preempted(step)

    def _save(self, manager: CheckpointManager, backend: TrainingBackend, step: int, cursor: int,
              values: dict[str, Any]) -> None:
        state = backend.state_dict()
        state["trainer"] = {"cursor": cursor, "global_batch_size": self.cfg.data.global_batch_size}
        state["config"] = self.cfg.to_dict()
        # An async save copies parameters and optimizer state while the next step's forward and backward
        # run (they only read them; optim_step waits for the copy). Buffers, which forward may update in
        # place (BatchNorm statistics, DDP's buffer broadcast), are copied now.
        buffers = {name for name, _ in backend.model.named_buffers()}
        state["model"] = {k: v.clone() if k in buffers and isinstance(v, torch.Tensor) else v
                          for k, v in state["model"].items()}
        self._checkpoint_guard(lambda: manager.save(step, state, metrics=values, defer_copy=True))

    def _checkpoint_guard(self, action) -> None:
        """Run a save (or wait for one); by `checkpoint.on_error` a failure aborts or becomes a warning. Ranks out
        of step (`ArrivalError`) always abort: they cannot train on together."""
        try:
            action()
        except ArrivalError:
            raise
        except CheckpointError as exc:
            if self.cfg.checkpoint.on_error == "abort":
                raise
            log.warning("checkpoint save failed, training continues (checkpoint.on_error = 'continue'): %s", exc)

    def _resume(self, manager: CheckpointManager, backend: TrainingBackend, runtime: Runtime) -> tuple[int, int]:
        """(step, sample cursor) to start from: 0, 0 for a fresh run."""
        mode = self.cfg.checkpoint.resume
        if mode == "never" or (mode == "auto" and not manager.has_checkpoint()):  # rank 0's view of the folder
            return 0, 0
        target = backend.prepared.checkpoint_target
        if mode == "auto":
            state = manager.load("latest", target=target)
        else:
            path = Path(mode)
            state = CheckpointManager(path.parent, self.cfg.checkpoint, runtime).load(parse_step(path), target=target)
        check_resumable(state["config"], self.cfg)
        backend.load_state_dict(state)
        manifest = state["manifest"]
        if state["rank_state"] is not None and manifest["world_size"] == runtime.world_size:
            restore_rng(state["rank_state"]["rng"])
        elif runtime.is_main_process():
            log.info("world size %d -> %d: per-rank RNG states start fresh (the data stream continues exactly)",
                     manifest["world_size"], runtime.world_size)
        if runtime.is_main_process():
            log.info("resumed from checkpoint step %d (%s)", state["step"], manager.path(state["step"]))
            if self.cfg.parallel.grad_compression == "powersgd":
                log.warning("parallel.grad_compression = 'powersgd': its error-feedback buffers are not in checkpoints "
                            "(per rank, tied to DDP's bucket layout), so the resumed run is close to, not bitwise "
                            "equal to, an uninterrupted one")
        return int(state["step"]), int(state["trainer"]["cursor"])

    def _line_figures(self, values: dict[str, Any], runtime: Runtime) -> None:
        """Add a logged line's figures to `values`: this rank's work and wait since the previous line, then the
        ranks' summary (a collective: every rank calls it at the same steps)."""
        values.update(self.meter.line())
        values.update(rank_summary(values, runtime.device, runtime.distributed))

    def _train_step(self, backend: TrainingBackend, batches: Iterator[Any], micro_per_step: int) -> dict[str, Any]:
        """One optimizer step over this rank's next `micro_per_step` micro-batches of the stream."""
        self.meter.start()
        for i in range(micro_per_step):
            backend.on_phase("data")
            backend.forward_backward(next(batches), sync=i == micro_per_step - 1, values=False)  # no device read
        out = backend.optim_step()
        values = {"loss": out["loss"], "lr": out["lr"], "grad_norm": out["grad_norm"], "tokens": int(out["count"]),
                  **self.meter.stop(out["count"]), "skipped_steps": out["skipped_steps"],
                  "stop_requested": out["stop_requested"]}
        if "loss_scale" in out:
            values["loss_scale"] = out["loss_scale"]
        return values


def evaluate(backend: TrainingBackend, dataset: Dataset, runtime: Runtime, micro_batch_size: int,
             limit: int = 0, *, batches_of: Callable[[list[list[int]]], Iterable[Any]] | None = None,
             ) -> tuple[float, int]:
    """(mean loss, items counted) over the first `limit` samples (0 = all), each sample counted exactly
    once across ranks. `batches_of(index_lists)` yields the batches of those index lists (the Trainer's
    DataLoader, with its collate function); default: `fetch` with `collate` in this process.

    Ranks get contiguous shards whose sizes differ by at most one; every rank runs the same number of
    forward passes (a rank with a shorter shard repeats a batch and discards it), so strategies whose
    forward communicates never wait on a rank that has finished.
    """
    n = min(len(dataset), limit) if limit else len(dataset)
    shards, index = backend.data_parallel
    shard = eval_shard(n, shards, index)
    batches = split_micro(shard, micro_batch_size)
    rounds = math.ceil(math.ceil(n / shards) / micro_batch_size)
    padded = batches + [[0]] * (rounds - len(batches))
    built = iter(batches_of(padded)) if batches_of else (fetch(dataset, b) for b in padded)
    totals = torch.zeros(2, dtype=torch.float64, device=runtime.device)
    for i, batch in zip(range(rounds), built, strict=True):
        terms = backend.evaluate(batch)  # (None where another rank counts this shard's loss: pipeline, tensor)
        if terms is not None and i < len(batches):  # (a repeated batch only keeps the collectives in step)
            totals += torch.stack([terms[0].detach().double(), terms[1]])
    if runtime.distributed:
        dist.all_reduce(totals)
    loss_sum, count = totals.tolist()
    return (loss_sum / count if count > 0 else float("nan")), int(count)


# Settings a checkpoint cannot be resumed under when changed: they define the model, the sample stream or
# the optimizer state's meaning. Everything else (steps, lr, micro-batch, world size, strategy, ...) may change.
RESUME_FIXED = ("model.", "data.source", "data.global_batch_size", "data.shuffle", "data.val_fraction",
                "data.token_dtype", "data.tokenizer", "data.text_field", "run.seed", "optim.name")


def model_vocab_size(model: nn.Module, cfg: Config) -> int:
    """The vocabulary the model embeds: an HF model's config says it; otherwise `model.vocab_size`."""
    return int(getattr(getattr(model, "config", None), "vocab_size", None) or cfg.model.vocab_size)


def check_resumable(saved: dict[str, dict[str, Any]], cfg: Config) -> None:
    """ConfigError naming every fixed setting that differs from the checkpoint's config."""
    current = cfg.to_dict()
    diffs = []
    for section, values in saved.items():
        for key, old in values.items():
            name = f"{section}.{key}"
            new = current.get(section, {}).get(key)
            if name.startswith(RESUME_FIXED) and old != new:
                diffs.append(f"{name} was {old!r}, now {new!r}")
    if diffs:
        raise ConfigError("cannot resume: the checkpoint was saved with different settings (" + "; ".join(diffs)
                          + "); restore them, or start over with --resume never or another run.name")


def _flat_config(cfg) -> dict:
    """`section.key: value` for the experiment trackers' parameters."""
    return {f"{section}.{key}": value for section, values in cfg.to_dict().items() for key, value in values.items()}


def run_summary(cfg, start: int, last: int, seconds: float, result: TrainResult, manager: CheckpointManager) -> str:
    """The end-of-run line: steps, tokens, wall time, tokens/s, best eval, a straggler named on a quarter of the
    logged lines or more, last checkpoint."""
    steps = last - start
    tokens = steps * cfg.data.global_batch_size * cfg.model.seq_len
    hours, rest = divmod(int(seconds), 3600)
    parts = [f"done: steps {start + 1}-{last} ({steps}), {tokens:,} tokens in {hours}:{rest // 60:02d}:{rest % 60:02d} "
             f"({tokens / max(seconds, 1e-9):,.0f} tokens/s)", f"final loss {result.losses[-1]:.4f}"]
    if result.eval_losses:
        step, best = min(result.eval_losses.items(), key=lambda kv: kv[1])
        parts.append(f"best eval_loss {best:.4f} at step {step}")
    if result.stragglers:  # the rank named most often, where that was a quarter of the lines or more
        rank, ratios = max(result.stragglers.items(), key=lambda kv: len(kv[1]))
        if len(ratios) * 4 >= result.lines:
            parts.append(f"straggler: rank {rank} on {len(ratios)} of {result.lines} lines (median "
                         f"{statistics.median(ratios):.1f}x the others' work)")
    latest = manager.latest() if cfg.checkpoint.every else None
    parts.append(f"last checkpoint {manager.path(latest)}" if latest is not None else "no checkpoint")
    return "; ".join(parts)
