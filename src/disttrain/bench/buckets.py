"""DDP's gradient buckets as the scale model prices them (no torch): which trained tensors each bucket holds, the
all-reduces each makes (PowerSGD's factors included), and the units they make of a step."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from disttrain.bench.interconnect import Interconnect, collective_time
from disttrain.bench.model_shapes import ModelShape, UnitShape
from disttrain.bench.timeline import Unit
from disttrain.errors import ConfigError


def gradient_buckets(model: ModelShape, grad_bytes: int, bucket_bytes: float) -> list[float]:
    """DDP's gradient buckets in forward order (bytes), of the trained parameters: filled from the last parameter, a
    bucket closed once it holds `bucket_bytes` or more (whole tensors, where the model's are known), so the bucket
    reduced last (holding the first parameters) is the partial one."""
    if model.grad_tensors:
        return [sum(model.grad_tensors[i] for i in members) * grad_bytes
                for members in bucket_members(model.grad_tensors, grad_bytes, bucket_bytes)]
    total = model.trained_params * grad_bytes
    full, rest = divmod(total, bucket_bytes)
    return ([rest] if rest else []) + [bucket_bytes] * int(full)


def bucket_members(tensors: tuple[int, ...], grad_bytes: int, bucket_bytes: float) -> list[list[int]]:
    """The trained tensors (their indices) in each of DDP's buckets, in forward order (`gradient_buckets`)."""
    buckets, members, size = [], [], 0.0
    for i in reversed(range(len(tensors))):
        members.append(i)
        size += tensors[i] * grad_bytes
        if size >= bucket_bytes:
            buckets.append(members[::-1])
            members, size = [], 0.0
    return ([members[::-1]] if members else []) + buckets[::-1]


POWERSGD_MIN_COMPRESSION = 2
"""torch's `PowerSGDState.min_compression_rate`: a matrix is sent as factors only where they are this many times
smaller than it."""


def bucket_calls(model: ModelShape, work, stored: int, wire: int) -> tuple[list[float], list[list[float]]]:
    """(gradient bytes of each DDP bucket in forward order, the all-reduces it makes: bytes on the wire). Under
    powersgd (rank r, in the gradients' dtype), past its first two steps, torch's hook all-reduces a bucket's tensors
    it does not compress (vectors, and matrices whose factors would not be half their size or less), then the P
    factors (rows x r of each matrix), then the Q factors (cols x r), one after the other (a part with no bytes is
    an empty call: not counted); on a CPU (gloo) disttrain runs it with one bucket (parallel/ddp.py); on GPUs the
    hook's last step synchronizes the device on the backward's thread, so each bucket holds up the backward until
    its calls are done (`Unit.blocking`). The hook's own compute (the factors' matmuls, error feedback) is not
    counted: it is in a 1-rank step measured under powersgd, not in one measured without."""
    if work.grad_compression != "powersgd":
        buckets = gradient_buckets(model, stored, work.bucket_bytes)
        return buckets, [[b * wire / stored] for b in buckets]
    if not model.grad_rows:
        raise ConfigError(f"parallel.grad_compression = 'powersgd': the shapes of {model.name}'s gradients are not "
                          "known, so its low-rank factors cannot be counted; model a config (its model is counted "
                          "from its module tree) rather than --model")
    r, grads, calls = work.powersgd_rank, [], []
    for members in bucket_members(model.grad_tensors, stored, math.inf if work.cpu_cores else work.bucket_bytes):
        whole = p = q = 0.0
        for i in members:
            numel, rows = model.grad_tensors[i], model.grad_rows[i]
            cols = numel // rows if rows else 0
            if rows and (rows + cols) * r * POWERSGD_MIN_COMPRESSION < numel:
                p, q = p + rows * r, q + cols * r
            else:
                whole += numel
        grads.append(sum(model.grad_tensors[i] for i in members) * stored)
        calls.append([x * stored for x in (whole, p, q) if x])
    return grads, calls


def bucket_units(shapes: list[UnitShape], flops: float, buckets: list[float], calls: list[list[float]],
                  all_reduce: Callable[[float], float], net: Interconnect, n: int, blocking: bool = False
                  ) -> list[Unit]:
    """DDP's (and zero1's) units: one per bucket (`buckets`: its gradients' bytes, forward order; `calls`: the
    all-reduces it makes, one after the other, bytes on the wire; `all_reduce(bytes)` one's seconds), spread over
    the compute of the units from the first to the last that trains. The backward of the frozen units after that one
    comes first and readies no gradient (a frozen front's backward is nothing): a unit of their own, reducing
    nothing. `blocking`: each bucket's reduction holds up the backward (`Unit.blocking`)."""
    def shares(group: list[UnitShape]) -> tuple[float, float]:
        return sum(u.forward_flops for u in group) / flops, sum(u.backward_flops for u in group) / flops

    last = max((i for i, u in enumerate(shapes) if u.trained), default=-1)
    (forward, backward), tail = shares(shapes[:last + 1]), shapes[last + 1:]
    cpu = replace(net, intra=net.cpu, inter=net.cpu) if net.cpu else None
    units = [Unit(forward * b / sum(buckets), backward * b / sum(buckets), reduce=sum(map(all_reduce, sizes)),
                  reduce_cpu=sum(collective_time("all_reduce", c, n, cpu) for c in sizes) if cpu else None,
                  blocking=blocking)
             for b, sizes in zip(buckets, calls, strict=True)] or [Unit(forward, backward)]
    return units + ([Unit(*shares(tail))] if tail else [])


def waits_behind_backward(units: list[Unit]) -> float:
    """Seconds of DDP's bucket all-reduces that a host whose cores all run ranks does not pay, where their CPU time
    was measured: a bucket issued while backward goes on costs the step its CPU time (the backend's threads take the
    cores from compute), its waiting overlaps the compute; the bucket of the first parameters in forward order,
    issued when backward ends, is waited for whole."""
    buckets = [u for u in units if u.reduce_cpu is not None]
    return sum(u.reduce - min(u.reduce, u.reduce_cpu) for u in buckets[1:])
