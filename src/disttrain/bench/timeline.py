"""A step as a timeline of two streams, compute and one FIFO of collectives (no torch): the units a step runs, their
shares of compute and the seconds of their collectives (`Unit`), one pass over them (`run_pass`), and the step's
figures (`Step`). The scale model builds the units of each strategy (scale_model.py, buckets.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Unit:
    """What is gathered and reduced together (an FSDP block or root, a DDP bucket, or DDP's frozen units after the
    last trained one, which reduce nothing) and its shares of compute."""

    forward: float
    backward: float
    """Shares of the step's compute (of forward + backward + the optimizer's step, which the backward share holds)."""
    gather_fwd: float = 0.0
    gather_bwd: float = 0.0
    reduce: float = 0.0
    """Seconds of each collective."""
    reduce_cpu: float | None = None
    """A DDP bucket's all-reduce: its CPU seconds on the process group's threads, where measured
    (`Interconnect.cpu`)."""
    blocking: bool = False
    """The reduction holds up the compute until it is done: PowerSGD's hook on GPUs, whose last step synchronizes the
    device (`torch.cuda.synchronize`) on the thread running the backward, at every bucket."""


@dataclass
class Step:
    step_s: float
    compute_s: float
    comm_s: float
    """Sum of the step's collective times, overlapped or not."""
    wire_bytes: float
    """Bytes each rank sends per step (the collectives' sizes x bus factor)."""

    @property
    def exposed_s(self) -> float:
        return self.step_s - self.compute_s


def run_pass(units: list[Unit], seconds: float, part: str, gather: str, reduce: bool, t: float, comm: float,
          depth: int = 1) -> tuple[float, float]:
    """One forward or backward pass over `units` (in execution order) on two streams, compute and one FIFO of
    collectives: a unit starts when its all-gather is done; the all-gathers of the next `depth` units are issued
    when a unit starts (FSDP2 prefetches one implicitly; `parallel.fsdp_prefetch` sets more, for the blocks: the
    root, first in forward, prefetches one); a unit's reduction is issued when its backward ends."""
    def issue(u: Unit, at: float) -> float:
        nonlocal comm
        if not getattr(u, gather):
            return at
        comm = max(comm, at) + getattr(u, gather)
        return comm

    ready = [issue(units[0], t)]
    for i, u in enumerate(units):
        start = max(t, ready[i])
        ahead = 1 if i == 0 and part == "forward" else max(depth, 1)  # (the root's forward: FSDP2's implicit one)
        ready += [issue(units[j], start) for j in range(len(ready), min(i + ahead + 1, len(units)))]
        t = start + getattr(u, part) * seconds
        if reduce and u.reduce:
            comm = max(comm, t) + u.reduce
            t = comm if u.blocking else t
    return t, comm
