"""`ddp`: torch DistributedDataParallel, gradients all-reduced in buckets overlapping backward.

Accumulation micro-batches run under DDP's own `no_sync()`, so only the last micro-batch of a step
communicates. `parallel.grad_compression` picks DDP's communication hook (comm.py); every hook is timed.

The step clears gradients to None (spec.py), so each backward's gradients are new tensors that DDP copies into its
buckets. `batched_grad_copy` (torch >= 2.13) makes that one `_foreach_copy_` per bucket, not one copy per parameter:
on a GPU the host issued one memcpy per parameter per step before.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import NoReturn

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from disttrain.errors import ConfigError
from disttrain.parallel import comm, layout
from disttrain.parallel.spec import Prepared, StrategySpec

log = logging.getLogger(__name__)
BATCHED_GRAD_COPY = "batched_grad_copy" in inspect.signature(DistributedDataParallel).parameters
"""torch >= 2.13 (the floor): False only where disttrain runs from source on an older torch (a GPU image)."""

OPTIONS = frozenset({"bucket_cap_mb", "gradient_as_bucket_view", "static_graph", "find_unused_parameters",
                     "grad_compression", "powersgd_rank"})


def static_graph_refusal(micro_batches: str, one_micro_batch: str) -> str:
    """Why `parallel.static_graph` cannot accumulate: torch's DDP crashes under `no_sync()` with a static graph
    (`expect_autograd_hooks_ INTERNAL ASSERT FAILED`), and the pending fix says that once past the crash it stops
    all-reducing from the second step (pytorch/pytorch#143580, #187732)."""
    return (f"parallel.static_graph = true with {micro_batches} micro-batches per optimizer step: torch's DDP "
            "cannot accumulate gradients (no_sync) with a static graph (pytorch/pytorch#143580); set "
            f"parallel.static_graph = false, or {one_micro_batch}")


DDP_ONLY = ("bucket_cap_mb", "gradient_as_bucket_view", "static_graph", "find_unused_parameters")
"""Settings only torch's DDP reads: under a pipeline, tensor or context layout the data axis is FSDP2's replicate."""


def check(cfg, data: int) -> None:
    """Refuse DDP's own settings where no DDP runs (a model-parallel layout), and a static graph where the Trainer
    accumulates."""
    d, p = cfg.data, cfg.parallel
    if p.pipeline > 1 or p.tensor > 1 or p.context > 1:  # (as mesh.MeshLayout.model_parallel)
        defaults = {f.name: f.default for f in dataclasses.fields(p)}  # (config is a layer above: not imported)
        for key in DDP_ONLY:
            if getattr(p, key) != defaults[key]:
                raise ConfigError(f"parallel.{key} = {getattr(p, key)!r} has no effect under parallel.pipeline / "
                                  "tensor / context > 1, where the data axis runs FSDP2's replicate, not DDP; "
                                  f"remove parallel.{key}")
        return
    accumulation = d.global_batch_size // (d.micro_batch_size * data)
    if p.static_graph and accumulation > 1:
        raise ConfigError(static_graph_refusal(
            str(accumulation), f"data.micro_batch_size = {d.global_batch_size // data} (one per step)"))


def _no_sync_refused() -> NoReturn:
    raise ConfigError(static_graph_refusal("several", "one micro-batch per optimizer step (sync=True on each)"))


def apply(model, runtime, cfg, mesh=None) -> Prepared:
    if mesh is not None:  # the data axis of a pipeline / tensor-parallel layout (parallel/compose.py)
        from disttrain.parallel import fsdp

        return fsdp.replicate(model, runtime, cfg, mesh)
    device_ids = [runtime.device.index] if runtime.device.type == "cuda" else None
    bucket_cap_mb = cfg.bucket_cap_mb
    if cfg.grad_compression == "powersgd" and dist.get_backend() == "gloo":
        # PowerSGD's hook hangs on gloo when a step has several buckets in flight: one bucket for everything
        bucket_cap_mb = max(bucket_cap_mb, comm.single_bucket_mb(model))
        if runtime.is_main_process() and bucket_cap_mb != cfg.bucket_cap_mb:
            log.info("powersgd on gloo: one gradient bucket of %.0f MiB (parallel.bucket_cap_mb = %g would give "
                     "several, and PowerSGD hangs on gloo with several)", bucket_cap_mb, cfg.bucket_cap_mb)
    ddp = DistributedDataParallel(
        model,
        device_ids=device_ids,
        bucket_cap_mb=bucket_cap_mb,
        gradient_as_bucket_view=cfg.gradient_as_bucket_view,
        static_graph=cfg.static_graph,
        find_unused_parameters=cfg.find_unused_parameters,
        **({"batched_grad_copy": True} if BATCHED_GRAD_COPY else {}),
    )
    meter = comm.meter_for(runtime.device, cfg.grad_compression)
    if meter is not None or cfg.grad_compression != "none":
        ddp.register_comm_hook(*comm.ddp_hook(cfg.grad_compression, meter, cfg.powersgd_rank))
    return Prepared(module=ddp, model=model, no_sync=_no_sync_refused if cfg.static_graph else ddp.no_sync,
                    grads_averaged_over=runtime.world_size, comm=meter)


def memory(shapes, cfg, world: int, rank: int | None, mesh=None) -> layout.MemoryLayout:
    if mesh is not None:  # the data axis of a pipeline / tensor-parallel layout runs as FSDP2 replicate (`apply`)
        from disttrain.parallel import fsdp

        return fsdp.memory_replicate(shapes, cfg, world, rank)
    return with_buckets(layout.replicated(shapes, cfg, world, rank), cfg, world)


def with_buckets(out: layout.MemoryLayout, cfg, world: int) -> layout.MemoryLayout:
    """DDP's communication buckets, as many bytes as the gradients, beside the gradients themselves where both are
    held at once: always without `gradient_as_bucket_view`, and with it while a step accumulates. The step clears
    the gradients to None, so the micro-batches before the last one (under `no_sync`) accumulate into new tensors
    that DDP copies into its buckets only at the last one (memory.measure sees both)."""
    d = cfg.data
    accumulates = d.global_batch_size > d.micro_batch_size * world
    if not cfg.parallel.gradient_as_bucket_view or accumulates:
        out.grads *= 2
        out.notes.append("ddp: gradients and their communication buckets held at once ("
                         + ("parallel.gradient_as_bucket_view = false)" if not cfg.parallel.gradient_as_bucket_view
                            else "accumulation: the gradients of the micro-batches before the last one)"))
    return out


SPECS = (StrategySpec("ddp", apply, "DistributedDataParallel: replicated model, bucketed gradient all-reduce",
                      memory, options=OPTIONS, check=check, data_axes=lambda p, data: (data, 1)),)
