"""Distributed utilities for RL and research loops: metric reduction, barrier, variable-size gather,
whitening. Each works on the default process group and degrades to the local answer without one.

Nothing here pickles: `dist.all_gather_object` would, so variable-size results travel as tensors (and
JSON-able values as UTF-8 bytes in a tensor).
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_metrics(metrics: dict[str, float], op: str = "mean") -> dict[str, float]:
    """`mean`, `sum`, `min` or `max` of each metric over all ranks, in one all-reduce (every rank must pass
    the same keys)."""
    if op not in ("mean", "sum", "min", "max"):
        raise ValueError(f"op = {op!r}: choose mean, sum, min or max")
    keys = sorted(metrics)
    values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=_device())
    if _distributed():
        reduce_op = {"mean": dist.ReduceOp.SUM, "sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN,
                     "max": dist.ReduceOp.MAX}[op]
        dist.all_reduce(values, op=reduce_op)
        if op == "mean":
            values /= dist.get_world_size()
    return dict(zip(keys, values.tolist(), strict=True))


def barrier() -> None:
    if _distributed():
        dist.barrier()


def gather_variable(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's `tensor` (sizes along dim 0 may differ; other dims and dtype must match), in rank order,
    on every rank."""
    if not _distributed():
        return [tensor]
    device = _device()
    local = tensor.to(device).contiguous()
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([local.shape[0] if local.dim() else 1], dtype=torch.int64, device=device))
    longest = max(int(s.item()) for s in sizes)
    flat = local.reshape(-1, *local.shape[1:]) if local.dim() else local.reshape(1)
    padded = torch.zeros((longest, *flat.shape[1:]), dtype=flat.dtype, device=device)
    padded[: flat.shape[0]] = flat
    gathered = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(gathered, padded)
    return [g[: int(s.item())].to(tensor.device) for g, s in zip(gathered, sizes, strict=True)]


def gather_json(value: Any) -> list[Any]:
    """Every rank's JSON-able `value`, in rank order, on every rank (no pickle: UTF-8 bytes in a tensor)."""
    data = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
    return [json.loads(bytes(t.tolist())) for t in gather_variable(data)]


def whiten(values: torch.Tensor, mask: torch.Tensor | None = None, eps: float = 1e-8,
           shift_mean: bool = True) -> torch.Tensor:
    """(values - mean) / std with mean and std over the elements of all ranks (those where `mask` is true),
    as if the whole global batch were on one rank: one all-reduce of (sum, sum of squares, count)."""
    x = values.detach().double()
    m = torch.ones_like(x) if mask is None else mask.to(x.dtype)
    totals = torch.stack([(x * m).sum(), (x * x * m).sum(), m.sum()]).to(_device())
    if _distributed():
        dist.all_reduce(totals)
    total, total_sq, count = totals.tolist()
    if count < 2:
        raise ValueError(f"whiten() needs at least 2 elements over all ranks, got {count:g}")
    mean = total / count
    var = (total_sq - count * mean * mean) / (count - 1)  # unbiased, as torch.std
    out = (values - mean) * (1.0 / (max(var, 0.0) ** 0.5 + eps))
    return out if shift_mean else out + mean
