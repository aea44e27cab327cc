"""A step's totals: what its micro-batches add up on this rank (the summed loss, the item count, whether a loss was
non-finite) and the one small all-reduce that makes them global, with a flag per rank whose loss was non-finite and
whether any rank asked to stop. The backend (backend.py) normalises, refuses and stops by them."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class StepTotals:
    def __init__(self, runtime: Any, prepared: Any):
        self.runtime, self.prepared = runtime, prepared  # (the strategy's communication meter: `prepared.comm`)
        self.stop_requested = False
        """Set by `TrainingBackend.request_stop` (kept across steps): every rank learns it from the next all-reduce."""
        self.reset()

    def reset(self) -> None:
        zero = torch.zeros((), dtype=torch.float64, device=self.runtime.device)
        self.loss_sum, self.count, self.nonfinite = zero, zero.clone(), zero.clone()  # (nonfinite 1: inf/NaN seen)
        self.micro_batches = 0
        self.unsynced = False
        self._reduced: tuple[Any, torch.Tensor, int] | None = None  # (all-reduce in flight, buffer, micro-batches)

    def add(self, loss_sum: torch.Tensor, nonfinite: torch.Tensor, count: torch.Tensor) -> None:
        """A micro-batch's (or a pipeline's step's, at once) summed loss, non-finite flag (the step's so far,
        included) and item count."""
        self.loss_sum, self.count, self.nonfinite = self.loss_sum + loss_sum, self.count + count, nonfinite

    def ran(self, sync: bool) -> None:
        """A micro-batch ran (`sync=False`: its gradients were not reduced; the step may not end on it)."""
        self.micro_batches += 1
        self.unsynced = not sync

    def start_with(self, loss_sum: torch.Tensor, nonfinite: torch.Tensor, count: torch.Tensor) -> None:
        """`start` with the step's last micro-batch, not added yet (its backward is still to run)."""
        self.start(self.loss_sum + loss_sum, self.count + count, nonfinite, self.micro_batches + 1)

    def start(self, loss_sum: torch.Tensor, count: torch.Tensor, nonfinite: torch.Tensor, micro_batches: int) -> None:
        """Start the step's one small all-reduce: global loss sum, global item count, which ranks saw a
        non-finite loss, whether any rank asked to stop (a request that comes later is seen next step).

        On gloo it runs while the backward computes. Under NCCL the compute stream waits for it at once
        (the CPU does not): torch requires that before another communicator (DeepSpeed's, HSDP's groups)
        is used, and the backward's reductions would otherwise run concurrently with it. So on a GPU a rank
        that finished its micro-batches' forwards first waits here for the slowest: the device-timed
        communication meter counts this all-reduce's time (not its bytes) in `comm_s`, which a GPU's straggler
        figure reads as the rank's wait (perf.StepMeter)."""
        if self._reduced is not None and self._reduced[0] is not None:
            self._reduced[0].wait()  # one started by an earlier sync=True micro-batch: finish it (every rank has)
        world, rank = self.runtime.world_size, self.runtime.rank
        flags = torch.zeros(world + 1, dtype=torch.float64, device=self.runtime.device)
        flags[rank] = nonfinite
        flags[world] = float(self.stop_requested)
        totals = torch.cat([torch.stack([loss_sum, count]), flags])
        work = dist.all_reduce(totals, async_op=True) if self.runtime.distributed else None
        if work is not None and self.runtime.device.type != "cpu":
            meter = self.prepared.comm
            if meter is not None and meter.on_device:
                meter.timed(work, 0, 0.0)  # nccl's timing of it; the step's bookkeeping, not the model's bytes
            work.wait()
            work = None
        self._reduced = (work, totals, micro_batches)

    def done(self) -> torch.Tensor:
        """The step's totals (global loss sum, global item count, a flag per rank whose loss was non-finite, stop
        requested anywhere) on the device, from the all-reduce the last micro-batch started (again if micro-batches
        came after it), once it has finished."""
        if self._reduced is None or self._reduced[2] != self.micro_batches:
            self.start(self.loss_sum, self.count, self.nonfinite, self.micro_batches)
        work, totals, _ = self._reduced
        if work is not None:
            work.wait()
        return totals

    def parse(self, values: list[float]) -> tuple[float, float, list[int], bool]:
        """(global loss sum, global item count, ranks whose loss was non-finite, stop requested anywhere)."""
        world = self.runtime.world_size
        return values[0], values[1], [r for r in range(world) if values[2 + r] > 0], values[2 + world] > 0
