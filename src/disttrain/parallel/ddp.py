"""`ddp`: torch DistributedDataParallel, gradients all-reduced in buckets overlapping backward.

Accumulation micro-batches run under DDP's own `no_sync()`, so only the last micro-batch of a step
communicates.
"""

from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel

from disttrain.parallel import layout
from disttrain.parallel.spec import Prepared, StrategySpec

OPTIONS = frozenset({"bucket_cap_mb", "gradient_as_bucket_view", "static_graph", "find_unused_parameters"})


def apply(model, runtime, cfg) -> Prepared:
    device_ids = [runtime.device.index] if runtime.device.type == "cuda" else None
    ddp = DistributedDataParallel(
        model,
        device_ids=device_ids,
        bucket_cap_mb=cfg.bucket_cap_mb,
        gradient_as_bucket_view=cfg.gradient_as_bucket_view,
        static_graph=cfg.static_graph,
        find_unused_parameters=cfg.find_unused_parameters,
    )
    return Prepared(module=ddp, model=model, no_sync=ddp.no_sync, grads_averaged_over=runtime.world_size)


def memory(shapes, cfg, world: int, rank: int | None) -> layout.MemoryLayout:
    out = layout.replicated(shapes, cfg, world, rank)
    if not cfg.parallel.gradient_as_bucket_view:
        out.grads *= 2  # gradients plus DDP's communication buckets
    return out


SPECS = (StrategySpec("ddp", apply, "DistributedDataParallel: replicated model, bucketed gradient all-reduce",
                      memory, options=OPTIONS),)
