"""DeepSpeed ZeRO's per-rank memory layout, as DeepSpeed 0.19 allocates it with the user's torch optimizer (fp32;
its master copy counted with the optimizer). Pure arithmetic for the memory estimator.

    stage 0     everything replicated, like ddp.
    stages 1-2  each optimizer group is flattened (padded to 2 x world elements) and cut into `world` equal
                partitions. A rank keeps the full parameters, an fp32 master copy of its partition with the
                optimizer state over it, and after backward the gradients of every parameter that starts in
                or straddles into its partition -- whole, so a partition boundary costs up to one parameter.
    stage 3     each parameter is cut into `world` padded partitions; parameters of at most
                stage3_param_persistence_threshold elements also stay whole on every rank. Gradients live in
                a flat buffer of the partitions plus one persistent bucket of reduce_bucket_size elements.
    cpu_offload stages 1-2 hold a host fp32 gradient partition, a 16-bit staging copy of the partition and two
                buffers of the largest parameter instead (no straddling); stage 3 adds the partitions' fp32
                gradients on the host. Host and device bytes are counted alike.
"""

from __future__ import annotations

import math

from disttrain.parallel.deepspeed.config import DEFAULT_REDUCE_BUCKET, DeepSpeedConfig
from disttrain.parallel.layout import MemoryLayout, dtype_bytes, optimizer_bytes, param_groups


def zero_settings(cfg, world: int, numel: int) -> dict:
    """The engine JSON's `zero_optimization` as the `deepspeed` strategy runs it, with DeepSpeed 0.19's
    defaults filled in for the keys that size its buffers."""
    zero = DeepSpeedConfig.from_parallel(cfg.parallel, world, cfg.optim.grad_clip, model_numel=numel).to_dict()
    defaults = {"reduce_bucket_size": DEFAULT_REDUCE_BUCKET, "contiguous_gradients": True,
                "round_robin_gradients": False, "stage3_param_persistence_threshold": 100_000,
                "stage3_model_persistence_threshold": 2**63 - 1}
    return {**defaults, **zero["zero_optimization"]}


def memory(shapes, cfg, world: int, rank: int | None) -> MemoryLayout:
    """Bytes on `rank` (None: the most loaded one)."""
    elem = dtype_bytes(cfg.parallel.precision)
    numels = [math.prod(s) for s in shapes]
    groups = [[numels[i] for i in g] for g in param_groups(shapes)]
    stage, total = cfg.parallel.deepspeed_stage, sum(numels)
    notes = [f"deepspeed: ZeRO stage {stage} as DeepSpeed 0.19 allocates it (its fp32 master partition counted with "
             "the optimizer); ZeRO-1/2 add a reduce_bucket_size gradient bucket during backward"]
    if stage == 0:
        return MemoryLayout(total * elem, total * elem, optimizer_bytes(numels, elem, cfg.optim.name), notes=notes)
    linears = "autocast"
    if stage in (1, 2):
        parts = [math.ceil(sum(g) / (2 * world)) * 2 for g in groups]  # partition elements per group
        held = [sum(sum(_in_partition(g, part, r)) for g, part in zip(groups, parts, strict=True)) * elem
                for r in range(world)]
        if cfg.parallel.cpu_offload:  # a host fp32 gradient partition, a 16-bit staging copy, two temp buffers
            held = [sum(parts) * (4 + elem) + 2 * max(numels) * elem] * world
        params, grads = total * elem, held[rank] if rank is not None else max(held)
    else:
        linears = "zero3"  # ZeRO-3's memory-efficient linear saves the parameter, not a 16-bit copy
        zero = zero_settings(cfg, world, total)
        parts = [sum(math.ceil(n / world) for n in g) for g in groups]  # each parameter cut in `world`
        persistent, threshold = 0, zero["stage3_param_persistence_threshold"]
        for n in numels:  # in model order, as DeepSpeed marks them
            if n <= threshold and persistent + n <= zero["stage3_model_persistence_threshold"]:
                persistent += n
        params = (sum(parts) + (persistent if world > 1 else 0)) * elem  # one rank: the partition is the parameter
        bucket = zero["reduce_bucket_size"] * elem if zero["contiguous_gradients"] else 0
        offload = sum(parts) * 4 if cfg.parallel.cpu_offload else 0  # the partitions' fp32 gradients on the host
        grads = sum(parts) * 4 + bucket + offload
        if persistent:
            notes.append(f"deepspeed: {persistent / total:.0%} of the parameters are at most "
                         f"stage3_param_persistence_threshold = {threshold} elements each and stay whole on every "
                         "rank (DeepSpeed's default for small tensors)")
    # the user's optimizer steps one flat fp32 partition per group; DeepSpeed's master copy is that partition
    return MemoryLayout(params, grads, optimizer_bytes(parts, elem, cfg.optim.name) + sum(parts) * 4, linears, notes)


def _in_partition(numels: list[int], part: int, rank: int) -> list[int]:
    """Sizes of the parameters DeepSpeed ZeRO-1/2 counts in `rank`'s partition of a flat group: those that
    start inside it, and the one that straddles its start."""
    start, end, offset, inside = part * rank, part * (rank + 1), 0, []
    for n in numels:
        if start <= offset < end or offset < start < offset + n:
            inside.append(n)
        offset += n
    return inside
