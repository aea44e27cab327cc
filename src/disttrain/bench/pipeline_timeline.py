"""A pipeline's step played through: each rank runs its schedule's computations in the order the schedule gives
it, each as soon as its rank is free and its input has arrived, and the step ends when the last rank is done. Pure
Python (the scale model's; no torch): the orders of torch's multi-stage schedules come from torch itself
(`parallel/placement.torch_order`, read where torch is at hand and handed in), those of gpipe and 1f1b are written
here.

A computation is (stage, kind), as torch's schedules run them (each stage takes its micro-batches in order):

    F   forward of the stage's next micro-batch: after the previous stage's F of it, sent over.
    B   the next micro-batch's full backward (its input and weight parts at once): after the next stage's B or I of
        it, sent back; on the last stage after its F.
    I   the input part of the next micro-batch's backward split in two (zero-bubble, zbv, dualpipev): as B; what the
        previous stage waits for.
    W   the weight part of the oldest micro-batch whose input part ran and whose weight part has not: on the same
        rank, after it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

Order = tuple[tuple[int, str], ...]
"""One rank's computations in a step: (stage, kind) each."""


@dataclass(frozen=True)
class StageCost:
    forward: float
    """Seconds of one micro-batch's forward through the stage (its compute and the tensor split's calls in it)."""
    backward: float
    """Seconds of its full backward's compute; split in two, each part half of it (a matmul's input and weight
    gradients cost the same FLOPs), unless `split` says."""
    backward_calls: float = 0.0
    """Seconds of the tensor split's calls in the backward: the input gradients', all in its input part."""
    split: tuple[float, ...] = ()
    """Seconds of the split backward's input and weight parts where they are not halves: measured apart (`bench
    pipeline`), or the first stage's (0, the whole backward and its calls): its input has no gradient, and torch runs
    its whole backward as the weight part."""

    def whole(self) -> float:
        """Seconds of one micro-batch's forward and backward through the stage, its calls included."""
        return self.forward + (sum(self.split) if self.split else self.backward + self.backward_calls)

    def of(self, kind: str) -> float:
        if kind == "F":
            return self.forward
        inputs, weights = self.split or (self.backward / 2,) * 2
        return {"B": self.backward + self.backward_calls, "I": inputs + self.backward_calls, "W": weights}[kind]


def one_stage_order(schedule: str, ranks: int, rank: int, microbatches: int) -> Order:
    """The order of a one-stage-per-rank schedule (torch's ScheduleGPipe, Schedule1F1B): gpipe every forward, then
    every backward; 1f1b p - 1 - r warm-up forwards, then a forward and a backward in turn, then the backwards left."""
    m = microbatches
    if schedule == "gpipe":
        return ((rank, "F"),) * m + ((rank, "B"),) * m
    warm = min(ranks - 1 - rank, m)
    steady = [(rank, kind) for _ in range(m - warm) for kind in ("F", "B")]
    return ((rank, "F"),) * warm + tuple(steady) + ((rank, "B"),) * warm


def play(orders: tuple[Order, ...], holder: Callable[[int], int], costs: tuple[StageCost, ...], hop_s: float,
         on_host: bool = False) -> list[float]:
    """The time each rank finishes its last computation, from t = 0. `holder(stage)`: the rank that runs it;
    `costs[stage]`; `hop_s`: seconds an activation (or its gradient) takes between ranks. On accelerators the sends
    run beside the compute, so a hop delays the computation waiting for it; `on_host` (a CPU host): each send and
    receive is a call on its rank's core (no delay besides): one in each computation but W whose micro-batch
    crosses to or from another rank, 2 v a micro-batch on a rank of v stages."""
    last = len(costs) - 1
    done: dict[tuple[int, str, int], float] = {}  # (stage, "F" | "I" (any input gradient), micro-batch) -> when
    seen: dict[tuple[int, str], int] = {}  # (stage, "F" | "I") -> micro-batches run
    free, next_up = [0.0] * len(orders), [0] * len(orders)
    weighted: dict[int, set[int]] = {}  # stage -> micro-batches whose weight gradients are done (a full backward's too)

    def crossing(stage: int, other: int) -> bool:
        return 0 <= other <= last and holder(other) != holder(stage)

    def ready(stage: int, kind: str, micro: int) -> float | None:
        """When the computation's input is at hand (None: not yet computed)."""
        if kind == "F":
            source = (stage - 1, "F", micro) if stage > 0 else None
        elif kind == "W":
            return done.get((stage, "I", micro))
        else:
            source = (stage + 1, "I", micro) if stage < last else (stage, "F", micro)
        if source is None:
            return 0.0
        if source not in done:
            return None
        hop = hop_s if crossing(stage, source[0]) and not on_host else 0.0
        return done[source] + hop

    remaining = sum(len(order) for order in orders)
    while remaining:
        progressed = False
        for rank, order in enumerate(orders):
            while next_up[rank] < len(order):
                stage, kind = order[next_up[rank]]
                done_w = weighted.setdefault(stage, set())
                micro = (next((i for i in range(seen.get((stage, "I"), 0)) if i not in done_w), -1) if kind == "W"
                         else seen.get((stage, "F" if kind == "F" else "I"), 0))  # (W: the oldest still without it)
                at = ready(stage, kind, micro)
                if at is None:
                    break
                calls = on_host and kind != "W" and (crossing(stage, stage - 1) or crossing(stage, stage + 1))
                free[rank] = max(free[rank], at) + costs[stage].of(kind) + calls * hop_s
                if kind in "WB":
                    done_w.add(micro)
                if kind != "W":
                    done[(stage, "F" if kind == "F" else "I", micro)] = free[rank]
                    seen[(stage, "F" if kind == "F" else "I")] = micro + 1
                next_up[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [(rank, order[next_up[rank]]) for rank, order in enumerate(orders) if next_up[rank] < len(order)]
            raise ValueError(f"the pipeline's orders wait on each other: each rank's next computation (rank, (stage, "
                             f"kind)) {stuck} waits for an input that never comes")
    return free
