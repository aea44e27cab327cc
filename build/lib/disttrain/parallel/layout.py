"""Per-rank memory layouts of parameters, gradients and optimizer state: the pure arithmetic each strategy's
spec uses for the memory estimator (`memory.estimate`). No torch tensors are created; shapes come in.

    replicated  every rank holds everything (single, ddp)
    zero1       replicated parameters and gradients; optimizer state partitioned the way torch's
                ZeroRedundancyOptimizer does (largest tensors first, to the least-loaded rank)
    sharded     FSDP2 shards of ceil(dim0 / shard group) rows (what FSDP2 allocates, padding included)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from disttrain.config import Config

Shape = tuple[int, ...]


@dataclass
class MemoryLayout:
    """Bytes on one rank, steady state."""

    params: int
    grads: int
    optimizer: int
    linears: str = "autocast"
    """What the linear layers save for backward under mixed precision (see activations.gpt_activation_bytes):
    "autocast" (16-bit weight copies), "gathered16" (FSDP2 gathers in 16 bits) or "zero3" (DeepSpeed)."""
    notes: list[str] = field(default_factory=list)


def dtype_bytes(precision: str) -> int:
    return 2 if precision == "bf16-true" else 4


def sharded_numel(shape: Shape, shards: int) -> int:
    if len(shape) == 0:
        return 1
    return math.ceil(shape[0] / shards) * math.prod(shape[1:])


def param_groups(shapes: list[Shape]) -> list[list[int]]:
    """Parameter indices of the optimizer's groups, in model order (optim.py: matrices decay, the rest not)."""
    groups = [[i for i, s in enumerate(shapes) if len(s) >= 2], [i for i, s in enumerate(shapes) if len(s) < 2]]
    return [g for g in groups if g]


def optimizer_bytes(numels: list[int], elem: int, optim: str) -> int:
    if optim == "sgd":
        return sum(numels) * elem
    return sum(numels) * 2 * elem + 4 * len(numels)  # exp_avg, exp_avg_sq, and a float32 step per tensor


def replicated(shapes: list[Shape], cfg: Config, world: int, rank: int | None) -> MemoryLayout:
    elem = dtype_bytes(cfg.parallel.precision)
    numels = [math.prod(s) for s in shapes]
    total = sum(numels) * elem
    return MemoryLayout(total, total, optimizer_bytes(numels, elem, cfg.optim.name))


def zero1_partition(shapes: list[Shape], world: int) -> list[list[int]]:
    """Parameter indices per rank, as ZeroRedundancyOptimizer assigns them (the default param groups)."""
    sizes, parts = [0] * world, [[] for _ in range(world)]
    for group in param_groups(shapes):
        for i in sorted(group, key=lambda i: math.prod(shapes[i]), reverse=True):
            rank = sizes.index(min(sizes))
            parts[rank].append(i)
            sizes[rank] += math.prod(shapes[i])
    return parts


def zero1(shapes: list[Shape], cfg: Config, world: int, rank: int | None) -> MemoryLayout:
    elem = dtype_bytes(cfg.parallel.precision)
    layout = replicated(shapes, cfg, world, rank)
    shares = [optimizer_bytes([math.prod(shapes[i]) for i in part], elem, cfg.optim.name)
              for part in zero1_partition(shapes, world)]
    layout.optimizer = shares[rank] if rank is not None else max(shares)
    layout.notes.append("zero1: optimizer state of the most loaded rank")
    return layout


def sharded(shapes: list[Shape], cfg: Config, shards: int) -> MemoryLayout:
    elem = dtype_bytes(cfg.parallel.precision)
    local = [sharded_numel(s, shards) for s in shapes]
    return MemoryLayout(sum(local) * elem, sum(local) * elem, optimizer_bytes(local, elem, cfg.optim.name),
                        linears="gathered16")
