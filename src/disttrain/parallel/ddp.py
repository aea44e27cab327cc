"""`ddp`: torch DistributedDataParallel, gradients all-reduced in buckets overlapping backward.

Accumulation micro-batches run under DDP's own `no_sync()`, so only the last micro-batch of a step
communicates. `parallel.grad_compression` picks DDP's communication hook (comm.py); every hook is timed.
"""

from __future__ import annotations

import logging

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from disttrain.parallel import comm, layout
from disttrain.parallel.spec import Prepared, StrategySpec

log = logging.getLogger(__name__)

OPTIONS = frozenset({"bucket_cap_mb", "gradient_as_bucket_view", "static_graph", "find_unused_parameters",
                     "grad_compression", "powersgd_rank"})


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
    )
    meter = comm.meter_for(runtime.device, cfg.grad_compression)
    if meter is not None or cfg.grad_compression != "none":
        ddp.register_comm_hook(*comm.ddp_hook(cfg.grad_compression, meter, cfg.powersgd_rank))
    return Prepared(module=ddp, model=model, no_sync=ddp.no_sync, grads_averaged_over=runtime.world_size,
                    comm=meter)


def memory(shapes, cfg, world: int, rank: int | None, mesh=None) -> layout.MemoryLayout:
    if mesh is not None:  # the data axis of a pipeline / tensor-parallel layout runs as FSDP2 replicate (`apply`)
        from disttrain.parallel import fsdp

        return fsdp.memory_replicate(shapes, cfg, world, rank)
    out = layout.replicated(shapes, cfg, world, rank)
    if not cfg.parallel.gradient_as_bucket_view:
        out.grads *= 2  # gradients plus DDP's communication buckets
    return out


SPECS = (StrategySpec("ddp", apply, "DistributedDataParallel: replicated model, bucketed gradient all-reduce",
                      memory, options=OPTIONS, data_axes=lambda p, data: (data, 1)),)
