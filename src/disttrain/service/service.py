"""TrainingService: the immediate-mode API (`forward_backward`, `optim_step`, ...) over a group of workers.

    service = await TrainingService.options(nproc=2, launcher="local").as_service(
        model_fn="pkg.mod:build_model", loss_fn="pkg.mod:loss", strategy="fsdp", precision="bf16-mixed")
    metrics = await service.forward_backward(batch)   # the global batch; each rank gets its slice
    metrics = await service.optim_step()
    out = await service.forward(batch)
    await service.save(path); await service.load(path)
    await service.shutdown()

The caller keeps the loop; each call runs on every worker (one rank each) through the same
TrainingBackend that `disttrain train` uses. The driver splits the global batch the way the sampler does
(rank r gets the r-th contiguous slice) and the backend normalises by the global item count, so the
results equal `disttrain train` and the single-process reference.

Failures (`on_failure`: `fail` or `restart`) and the group's life cycle: lifecycle.py.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from disttrain.errors import ConfigError
from disttrain.service.group import RemoteError, WorkerFailure
from disttrain.service.lifecycle import GroupLifecycle, WorkersRestarted
from disttrain.service.wire import concat, pack, rows, split_batch, unpack


@dataclass
class ServiceOptions:
    nproc: int = 1
    """Workers (ranks), as `dist.nproc`."""
    launcher: str = "local"
    """`local` (child processes) or `ray` (Ray actors in a placement group)."""
    on_failure: str = "fail"
    """`fail` (raise a WorkerFailure naming the worker) or `restart` (new group, newest checkpoint)."""
    heartbeat_s: float = 0.5
    """Seconds between worker heartbeats."""
    heartbeat_timeout_s: float = 10.0
    """A worker silent for this long is declared unresponsive (dead workers are detected at once)."""
    max_restarts: int = 3
    """`restart` policy: give up (and fail) after this many restarts."""
    checkpoint_dir: str | None = None
    """Default folder of `save()` and `load()`. A restart reloads the checkpoint this service last saved or
    loaded (fresh weights, step 0, if none)."""
    host: str = "127.0.0.1"
    """Address the driver listens on; loopback unless workers run on other machines (Ray, several nodes)."""
    threads_per_rank: int = 0
    """torch threads per worker, as `dist.threads_per_rank`; 0 = cores / nproc on a local machine, 1 on Ray."""
    device: str = "auto"
    """`auto`, `cpu` or `cuda`, as `dist.device`."""
    timeout_s: float = 300.0
    """As `dist.timeout_s`: a worker in one training phase longer than this (a `forward_backward` micro-batch's forward
    or backward, an `optim_step`, a `forward` call) is named stuck and the group fails (`on_failure` applies);
    `startup_timeout_s` before a worker's first `optim_step`. Also the collectives' timeout, with
    `startup_timeout_s` added."""
    startup_timeout_s: float = 180.0
    """How long workers may take to start and connect."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for the workers."""
    log_dir: str | None = None
    """Local backend: write each worker's output to LOG_DIR/worker<R>.log (default: the driver's terminal)."""
    ray_address: str | None = None
    """Ray: cluster address (None: the running cluster, or a new local one)."""
    placement: str = "PACK"
    """Ray: placement-group strategy, `PACK` or `SPREAD` (`STRICT_PACK`, `STRICT_SPREAD` too)."""
    cpus_per_worker: float = 1.0
    """Ray: CPUs reserved per worker."""
    gpus_per_worker: float = 0.0
    """Ray: GPUs per worker (fractions allowed)."""
    resources_per_worker: dict[str, float] = field(default_factory=dict)
    """Ray: other custom resources per worker."""

    def validate(self) -> None:
        from disttrain.config import ConfigError

        if self.nproc < 1:
            raise ConfigError(f"nproc = {self.nproc}: need at least 1 worker")
        if self.host.strip() in ("", "0.0.0.0", "::", "*"):
            raise ConfigError(f"host = {self.host!r} is where to listen, not an address workers on other nodes can "
                              "reach: give this machine's address on the network between the nodes (default "
                              "127.0.0.1: this machine only)")
        if self.launcher not in ("local", "ray"):
            raise ConfigError(f"launcher = {self.launcher!r}: choose 'local' or 'ray'")
        if self.on_failure not in ("fail", "restart"):
            raise ConfigError(f"on_failure = {self.on_failure!r}: choose 'fail' or 'restart'")
        if self.heartbeat_timeout_s <= self.heartbeat_s:
            raise ConfigError(f"heartbeat_timeout_s = {self.heartbeat_timeout_s:g} must exceed heartbeat_s = "
                              f"{self.heartbeat_s:g}")
        if self.placement not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
            raise ConfigError(f"placement = {self.placement!r}: choose PACK, SPREAD, STRICT_PACK or STRICT_SPREAD")

    async def as_service(self, model_fn: str | None = None, optimizer_fn: str | None = None,
                         loss_fn: str | Callable | None = None, *, model: Any = None, strategy: str = "auto",
                         precision: str = "fp32", model_args: dict | None = None, optimizer: Any = None,
                         optimizer_args: dict | None = None, parallel: dict | None = None, seed: int = 0,
                         grad_clip: float | None = None, total_steps: int = 0,
                         on_nonfinite: str = "stop") -> TrainingService:
        """Start the workers and build the model in each.

        model:        a live `nn.Module` built in this process (or a factory called as factory(**model_args)):
                      the local launcher then forks its workers, which inherit it (fork.py; no serialisation).
        model_fn:     or an import path: "pkg.mod:factory" called as factory(**model_args), "gpt" (model_args =
                      ModelConfig), or "hf:DIR", a local Hugging Face model directory (sharded strategies start it
                      sharded). Import paths work with every launcher (Ray, spawned processes).
        optimizer:    a dict of OptimConfig fields (disttrain's AdamW/SGD, with the warmup-cosine schedule when
                      `total_steps` > 0); or a live `torch.optim.Optimizer` over `model`'s parameters (each worker
                      rebuilds it with the same class and parameter groups over its wrapped or sharded model; its
                      state is not carried) or a factory(model), both forked like `model`.
        optimizer_fn: or an import path "pkg.mod:factory" called as factory(model, **optimizer_args).
        loss_fn:      "pkg.mod:fn" or a live function (forked), (outputs, batch) -> (sum, count) or a mean;
                      default: token cross-entropy (HF's label convention for a transformers model, losses.py).
        """
        live = {name: value for name, value in (("model", model), ("optimizer", optimizer), ("loss_fn", loss_fn))
                if value is not None and not isinstance(value, (str, dict))}
        if (model_fn is None) == (model is None) or isinstance(model, str):
            raise ConfigError("as_service: give either model= (a live nn.Module or factory) or model_fn= (an import "
                              "path, 'gpt' or 'hf:DIR')")
        if "optimizer" in live and optimizer_fn is not None:
            raise ConfigError("as_service: give either optimizer= (a live optimizer or factory) or optimizer_fn= "
                              "(an import path)")
        if not all(isinstance(v, str | None) for v in (model_fn, optimizer_fn)):
            raise ConfigError("as_service: model_fn and optimizer_fn are import paths ('pkg.mod:factory'); pass "
                              "objects as model= and optimizer=")
        if live:
            self._check_fork(live)
            model_fn = "live:model" if "model" in live else model_fn
            optimizer_fn = "live:optimizer" if "optimizer" in live else optimizer_fn
            loss_fn = "live:loss_fn" if "loss_fn" in live else loss_fn
            optimizer = None if "optimizer" in live else optimizer
        self.validate()
        setup = {"op": "setup", "model_fn": model_fn, "model_args": model_args or {}, "optimizer_fn": optimizer_fn,
                 "optimizer_args": optimizer_args or {}, "optimizer": optimizer or {}, "loss_fn": loss_fn,
                 "strategy": strategy, "precision": precision, "parallel": parallel or {}, "seed": seed,
                 "total_steps": total_steps, "on_nonfinite": on_nonfinite, "device": self.device,
                 "timeout_s": self.timeout_s, "startup_timeout_s": self.startup_timeout_s, "sys_path": _import_paths()}
        if grad_clip is not None:
            setup["grad_clip"] = grad_clip
        from disttrain.config import ParallelConfig
        from disttrain.parallel.mesh import layout_for

        # pipeline / tensor degrees checked as arithmetic before any worker starts
        layout = layout_for(ParallelConfig(strategy=strategy, precision=precision, **(parallel or {})), self.nproc)
        service = TrainingService(self, setup, layout, live)
        await service._start()
        service._started = True
        return service

    def _check_fork(self, live: dict[str, Any]) -> None:
        """Live objects reach workers only by forking: refuse, in one line, where that cannot happen."""
        from disttrain.service.fork import check_fork

        given = ", ".join(f"{k}=" for k in live)
        if self.launcher != "local":
            raise ConfigError(f"as_service({given}...): objects reach workers by forking the driver, which the "
                              f"{self.launcher!r} launcher cannot do; pass import paths (model_fn='pkg.mod:factory')")
        check_fork(f"as_service({given}...): cannot fork workers", gpu=self.device != "cpu")

    def as_blocking_service(self, *args: Any, **kwargs: Any):
        """`as_service` for a plain script: returns a `BlockingService` (callers.py) whose methods block until their
        call returns; same arguments."""
        from disttrain.service.callers import BlockingService

        return BlockingService.start(self, args, kwargs)

    async def as_anyio_service(self, *args: Any, **kwargs: Any):
        """`as_service` for trio or any anyio event loop: returns an `AnyioService` (callers.py); same arguments."""
        from disttrain.service.callers import AnyioService

        return await AnyioService.start(self, args, kwargs)


class TrainingService(GroupLifecycle):
    """See the module docstring. Create with `await TrainingService.options(...).as_service(...)`, or
    `as_blocking_service` / `await ...as_anyio_service` (callers.py) for a plain script or trio."""

    @staticmethod
    def options(**options: Any) -> ServiceOptions:
        return ServiceOptions(**options)

    def __init__(self, options: ServiceOptions, setup: dict[str, Any], layout=None,
                 live: dict[str, Any] | None = None):
        from disttrain.parallel.mesh import MeshLayout

        super().__init__(options, setup, live)
        self.layout = layout or MeshLayout(replicate=options.nproc)
        """How the ranks split the model (parallel/mesh.py): ranks of one data shard get the same slice of a batch,
        and one of them reports its loss and outputs."""

    def _split(self, batch: Any) -> list[Any]:
        """Each rank's slice of `batch`: one of `split_batch(batch, data-parallel degree)` (every rank its own unless
        pipeline stages or tensor shards share one)."""
        parts = split_batch(batch, self.layout.data)
        return [parts[self.layout.data_rank(rank)] for rank in range(self.nproc)]

    def _counted(self, replies: list, outputs: bool = False) -> list:
        """The replies of the ranks whose loss counts (one per data shard and sequence chunk), or with `outputs`
        whose outputs count (one per data shard), in data order."""
        counts = self.layout.counts_outputs if outputs else self.layout.counts_loss
        return [reply for rank, reply in enumerate(replies) if counts(rank)]

    def _scatter(self, shards: list[Any], **fields: Any) -> list[tuple[dict, dict]]:
        """One message per rank carrying its slice of the batch (`_split`)."""
        out = []
        for shard in shards:
            skeleton, tensors = pack(shard, "batch")
            out.append(({**fields, "batch": skeleton}, tensors))
        return out

    # -- the API -----------------------------------------------------------------------------------

    async def forward_backward(self, batch: Any, loss_fn: str | None = None, *, sync: bool = True,
                               micro_batch_size: int = 0) -> dict[str, float]:
        """Forward and backward the global `batch` (gradients accumulate until `optim_step`); returns the
        global mean loss of this batch and its item count.

        `micro_batch_size` > 0: each rank runs its slice in micro-batches of that many rows (gradient
        accumulation inside the workers, one round trip); `sync=False` defers the gradient reduction to a
        later call (accumulation across calls)."""

        async def action():
            shards = self._split(batch)
            # every rank runs the same number of micro-batches (collectives pair up), even when the
            # slices differ by a row: as many as the largest slice needs
            pieces = math.ceil(max(rows(s) for s in shards) / micro_batch_size) if micro_batch_size > 0 else 1
            messages = self._scatter(shards, op="forward_backward", sync=sync, loss_fn=loss_fn, micro_batches=pieces)
            self._micro_batches += 1  # before the call: after an error, gradients may have accumulated
            replies = self._counted(await self.group.all(messages))
            counts = [r["metrics"]["count"] for r, _ in replies]
            total = sum(counts)
            loss = sum(r["metrics"]["loss"] * c for (r, _), c in zip(replies, counts, strict=True)) / max(total, 1.0)
            return {"loss": loss, "count": total}

        return await self._run(action)

    async def optim_step(self) -> dict[str, Any]:
        """Normalise, clip, step and zero the gradients on every rank; returns the step's metrics."""

        async def action():
            try:
                replies = await self._every_rank({"op": "optim_step"})
            except RemoteError as exc:
                if exc.kind == "EmptyBatchError":  # every rank refused the step and dropped its gradients
                    self._micro_batches = 0
                raise
            metrics = replies[0][0]["metrics"]
            self.step, self._micro_batches = int(metrics["step"]), 0
            return metrics

        return await self._run(action)

    async def forward(self, batch: Any) -> Any:
        """Outputs of the model (eval mode, no gradients) for the global `batch`, in batch order."""

        async def action():
            replies = self._counted(await self.group.all(self._scatter(self._split(batch), op="forward")), outputs=True)
            return concat([unpack(r["result"], t) for r, t in replies])

        return await self._run(action)

    async def call(self, fn: str, batch: Any = None, **kwargs: Any) -> list[Any]:
        """Run `fn(shard, **kwargs)` ("pkg.mod:fn") on every rank with its slice of `batch`, together (so it
        may use `disttrain.collectives`); returns the results in rank order."""

        async def action():
            replies = await self.group.all(self._scatter(self._split(batch), op="call", fn=fn, kwargs=kwargs))
            return [unpack(r["result"], t) for r, t in replies]

        return await self._run(action)

    async def save(self, path: str | os.PathLike | None = None, metrics: dict[str, float] | None = None,
                   keep_last: int = 3) -> str:
        """Save a committed checkpoint of the current step under `path` (a CheckpointManager folder);
        returns the checkpoint's folder. A later restart reloads the newest checkpoint there."""
        folder = str(path or self.options.checkpoint_dir or "")
        if not folder:
            raise ValueError("save(): give a path or set checkpoint_dir in TrainingService.options()")

        async def action():
            if self._micro_batches:
                raise RuntimeError("save() between forward_backward() and optim_step(): the accumulated "
                                   "gradients are not part of a checkpoint; call optim_step() first")
            message = {"op": "save", "path": folder, "keep_last": keep_last, "metrics": metrics,
                       "strategy": self._setup["strategy"], "timeout_s": self.options.timeout_s}
            replies = await self._every_rank(message)
            self._checkpoint = (folder, self.step)
            return replies[0][0]["path"]

        return await self._run(action)

    async def load(self, path: str | os.PathLike | None = None, step: int | str = "latest") -> int:
        """Load checkpoint `step` (default the newest that verifies) from `path`; returns its step."""
        folder = str(path or self.options.checkpoint_dir or "")
        if not folder:
            raise ValueError("load(): give a path or set checkpoint_dir in TrainingService.options()")

        async def action():
            restored = await self._load(folder, step)
            self.step, self._micro_batches = restored, 0
            self._checkpoint = (folder, restored)
            return restored

        return await self._run(action)

    async def state_dict(self) -> dict[str, torch.Tensor]:
        """The full model weights (e.g. to sync a rollout policy)."""

        async def action():
            replies = await self._every_rank({"op": "state_dict"})
            return {k: v for _, tensors in replies for k, v in (tensors or {}).items()}  # (pipeline: each stage's)

        return await self._run(action)

    async def weight_sync(self, consumers: int = 1, *, dtype: str | None = None, bucket_mb: float = 64,
                          timeout_s: float = 60.0, delta: bool = True, host: str | None = None):
        """Open a weight sync to `consumers` inference engines (weights/): every rank listens on `host` (default
        the service's, loopback); hand `sync.endpoint` to each engine's `WeightReceiver`, then `await sync.push()`.
        `dtype` ("bfloat16", "float16", "float32"; None: the model's) is what travels; `delta` keeps a copy of what
        was sent so that `push(delta=True)` sends only the changed elements."""
        from disttrain.service.weights import WeightSync

        return await WeightSync.open(self, consumers, dtype, bucket_mb, timeout_s, delta, host or self.options.host)


def _import_paths() -> list[str]:
    """Where the driver imports code from (its sys.path, the working directory), so workers, Ray actors
    included, resolve the same factories."""
    paths = [os.getcwd(), *sys.path]
    return [os.path.abspath(p) for p in dict.fromkeys(paths) if p and os.path.isdir(p)]


__all__ = ["RemoteError", "ServiceOptions", "TrainingService", "WorkerFailure", "WorkersRestarted", "split_batch"]
