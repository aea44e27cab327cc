"""`ddp`: torch DistributedDataParallel, gradients all-reduced in buckets overlapping backward.

Accumulation micro-batches run under DDP's own `no_sync()`, so only the last micro-batch of a step
communicates.
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from disttrain.config import ParallelConfig
from disttrain.parallel import Prepared
from disttrain.runtime import Runtime


def apply(model: torch.nn.Module, runtime: Runtime, cfg: ParallelConfig) -> Prepared:
    if not runtime.distributed:
        raise ValueError("strategy 'ddp' needs an initialised process group (launch with --nproc N)")
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
