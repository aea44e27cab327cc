"""The strategies' gradient and parameter communication: how much time and how many bytes a step spends in it
(`CommMeter`), and gradient compression (`parallel.grad_compression`).

Measuring. Each strategy routes its own collectives through a thin timer, so nothing is sampled and nothing is
synchronised for the measurement:

- ddp / zero1: the DDP communication hook (the compression hook, or DDP's plain all-reduce) is wrapped; a bucket's
  all-reduce starts when the hook is called and ends when its future completes (a callback on gloo's thread).
- zero2 / fsdp / hsdp: FSDP2's all-gather and reduce-scatter are replaced by FSDP2's own default implementations
  wrapped the same way (`set_custom_all_gather` / `set_custom_reduce_scatter`).
- deepspeed: every collective of the engine goes through `deepspeed.comm`'s backend object (its `TorchBackend`);
  that object's collective methods are replaced by timed calls of the class's own (`deepspeed/timed.py`). This counts
  the engine's small all-reduces too (gradient norm, overflow flag), which are part of its step.

`comm_s` is the wall time during which at least one of them was in flight (the union of the intervals, so
overlapping buckets are not counted twice); `comm_bytes` is the size of the buffers handed to them, as nccl-tests
counts sizes (all-reduce: the buffer; all-gather: the gathered output; reduce-scatter: the input), in the dtype on
the wire. Which part the step waited for (`comm_exposed_s`) is worked out by the caller (perf.py). The step's own
small all-reduce of the loss totals is not counted on a CPU (it runs beside the backward, whose buckets wait for a
late rank). On CUDA its time is (not its bytes): the compute stream waits for it before the backward, so there it is
where a rank waits for the slowest one's forwards (totals.StepTotals.start).

On CUDA a collective's future completes when the work is queued, not done, so host clocks cannot time it. There
the device times it: an asynchronous collective by nccl itself, with CUDA events on its own stream
(`TORCH_NCCL_ENABLE_TIMING`, which `runtime.init_runtime` sets unless the user did; read as `Work._get_duration`);
a synchronous one (FSDP2's all-gather and reduce-scatter) by two CUDA events around the call on the caller's stream,
which the call holds until the collective is done. The meter keeps a collective until it has completed, then only its
duration, or for one timed by events its span on the device's clock (measured from the window's first event), so that
nothing piles up where no one calls `take()` (collectives are drained as new ones arrive and at `take()`). `comm_s` is
the union of the spans plus the sum of the durations. FSDP2 calls its all-gathers and reduce-scatters on streams of
their own: a reduce-scatter's span can overlap the next block's all-gather (it may even wait for it, nccl running one
communicator's collectives in turn), and a sum would count that time twice. nccl's own timing gives a Work's duration
alone, not its place on the clock: those collectives (DDP's buckets, in the order of the group's one stream, and
the step's totals) are summed. `comm_exposed_s`
stays None on CUDA per step (a device-side overlap needs a trace: the steps of `log.profile_steps` get it from
their kernels, perf.comm_overlap). DDP's hooks are replaced there by
`device_timed_hook` (torch's allreduce / fp16 / bf16 hooks with the Work in view: the same division and
all-reduce; this is also the path of `none` on a CPU, where DDP's built-in reducer is replaced by torch's
allreduce_hook); PowerSGD issues its all-reduces inside torch's hook, so under PowerSGD on CUDA comm_s is not
reported (None).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any

import torch

log = logging.getLogger(__name__)

COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")
WIRE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class CommMeter:
    """Intervals and bytes of one rank's collectives since the last `take()`. Thread-safe: completions arrive on
    the communication library's threads."""

    def __init__(self, on_device: bool = False):
        self.on_device = on_device
        """CUDA collectives: timed on the device (`_Timing`), not by host clocks."""
        self._lock = threading.Lock()
        self._intervals: list[tuple[float, float]] = []
        self._pending: list[_Timing] = []
        self._device_s = 0.0  # the Works' durations since `take()`
        self._spans: list[tuple[float, float]] = []  # the event-timed collectives', from `self._origin`
        self._origin: Any = None  # the window's first begin event, the clock the spans are read on
        self._bytes = 0
        self._untimed = False  # a collective of this window went untimed: its seconds are None

    def timed(self, work: Any, nbytes: int, start: float) -> Any:
        """Record a collective started at `start`. `work`: a Future (returned chained: whoever waits on it wakes
        only after the end was recorded), a Work, or None (it ran synchronously, and has ended). On the device,
        a Work (nccl's timing) or a `_Timing` of events."""
        with self._lock:
            self._bytes += nbytes
            if self.on_device:
                self._pending.append(work if isinstance(work, _Timing) else _Timing(work))
                self._drain(wait=False)
                return None if isinstance(work, _Timing) else work
        if work is None:
            self._done(start)
            return work
        if not hasattr(work, "get_future"):  # a Future (torch's own, or its C++ class that DDP hooks return)
            def done(future) -> Any:
                self._done(start)
                return future.value()

            return work.then(done)
        work.get_future().add_done_callback(lambda _: self._done(start))
        return work

    def untimed(self, nbytes: int) -> None:
        """A collective whose bytes are known and whose time is not: the seconds of this window are None."""
        with self._lock:
            self._bytes += nbytes
            self._untimed = True

    def in_flight(self) -> int:
        """Device collectives not finished when last looked at (all that the meter holds)."""
        with self._lock:
            return len(self._pending)

    def _drain(self, wait: bool) -> None:
        """Turn completed device collectives into seconds (all of them with `wait`); caller holds the lock."""
        if wait and self._pending and torch.cuda.is_available():
            torch.cuda.synchronize()  # the step has read its loss back, so this waits for little or nothing
        keep = []
        for timing in self._pending:
            if timing.begin is not None and self._origin is None:
                self._origin = timing.begin
            if not wait and not (timing.done() and (timing.begin is None or self._origin.query())):
                keep.append(timing)
                continue
            span = timing.span(self._origin) if timing.begin is not None else None
            if span is not None:
                self._spans.append(span)
                continue
            seconds = timing.seconds()  # None for one still running after the wait: not timed, not guessed
            if seconds is None:
                self._untimed = True
            else:
                self._device_s += seconds
        self._pending = keep

    def _done(self, start: float) -> None:
        end = time.perf_counter()
        with self._lock:
            self._intervals.append((start, end))

    def take(self) -> tuple[float | None, int]:
        """(seconds with a collective in flight, bytes) since the previous call; resets both. On the device the
        seconds are None where a collective could not be timed (nccl's timing off, or gloo)."""
        with self._lock:
            if self.on_device:
                self._drain(wait=True)
            seconds = self._device_s + union_length(self._spans) if self.on_device else union_length(self._intervals)
            out = (None if self._untimed else seconds), self._bytes
            self._intervals, self._spans, self._device_s, self._bytes, self._untimed = [], [], 0.0, 0, False
            self._origin = None
            return out


def merge_intervals(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of (start, end) intervals, as sorted disjoint intervals."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Time with at least one of the (start, end) intervals in progress."""
    return sum(end - start for start, end in merge_intervals(intervals))


class _Timing:
    """One collective timed on the device: by its Work (nccl's own events), or by two CUDA events around a
    synchronous call (`around`); without a device (gloo, in tests) a synchronous call has no timing (None)."""

    def __init__(self, work: Any = None, begin: Any = None, end: Any = None):
        self.work, self.begin, self.end = work, begin, end

    @staticmethod
    def around(call):
        """(call's result, its timing): the call runs between two events recorded on the current stream."""
        if not torch.cuda.is_available():
            return call(), _Timing()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        result = call()
        end.record()
        return result, _Timing(begin=begin, end=end)

    def done(self) -> bool:
        if self.work is not None:
            return self.work.is_completed()
        return self.end is None or self.end.query()

    def span(self, origin: Any) -> tuple[float, float] | None:
        """(begin, end) in seconds after the event `origin` (negative where the begin came first on the device;
        both events must have completed), or None where the events cannot be read."""
        try:
            return origin.elapsed_time(self.begin) / 1e3, origin.elapsed_time(self.end) / 1e3
        except (AttributeError, RuntimeError, ValueError):
            return None

    def seconds(self) -> float | None:
        try:
            if self.work is not None:  # nccl's own start/end events (private API: no public one reads them)
                return self.work._get_duration() / 1e3  # milliseconds
            return self.begin.elapsed_time(self.end) / 1e3 if self.end is not None else None
        except (AttributeError, RuntimeError, ValueError):  # timing off, or a backend that does not time
            return None


def meter_for(device: torch.device, compression: str = "none") -> CommMeter | None:
    """The strategy's meter: host clocks on a CPU, nccl's own timing on CUDA (none under PowerSGD there, whose
    all-reduces happen inside torch's hook), none on other devices."""
    if device.type == "cpu":
        return CommMeter()
    if device.type == "cuda" and compression != "powersgd":
        return CommMeter(on_device=True)
    return None


def nbytes_of(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


# ----------------------------------------------------------------------------------------------
# DDP: compression hooks, timed


def bf16_hook(process_group, bucket):
    """torch's bf16 compression hook under another name: DDP refuses the name `bf16_compress_hook` unless it runs
    on NCCL, although gloo all-reduces bfloat16 fine (the hook casts, all-reduces and copies back)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks._compress_hook(torch.bfloat16, process_group, bucket)


def _powersgd_bytes(bucket, state) -> int:
    """Bytes PowerSGD all-reduces for `bucket`: the low-rank factors P (n x r) and Q (m x r) of each matrix it
    compresses, and the other tensors whole; the full buffer before `start_powerSGD_iter`."""
    buffer = bucket.buffer()
    if state.iter < state.start_powerSGD_iter:
        return nbytes_of(buffer)
    rank, total = state.matrix_approximation_rank, 0
    for grad in bucket.gradients():
        rows = grad.shape[0] if grad.dim() > 1 else 1
        cols = grad.numel() // rows
        compressed = grad.dim() > 1 and (rows + cols) * rank * state.min_compression_rate < rows * cols
        total += ((rows + cols) * rank if compressed else grad.numel()) * buffer.element_size()
    return total


def ddp_hook(compression: str, meter: CommMeter | None, powersgd_rank: int = 1):
    """(state, hook) to register on a DDP module for `compression`, timed by `meter` when given."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if compression == "powersgd":
        # start after DDP has rebuilt its buckets (iteration 1); error feedback keeps it unbiased over steps
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=powersgd_rank,
                                            start_powerSGD_iter=2)
        inner, size = powerSGD_hook.powerSGD_hook, functools.partial(_powersgd_bytes, state=state)
    else:
        state = None
        inner = {"none": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook,
                 "bf16": bf16_hook}[compression]
        wire = WIRE_DTYPES.get(compression)
        size = (lambda bucket: bucket.buffer().numel() * wire.itemsize) if wire else \
            (lambda bucket: nbytes_of(bucket.buffer()))
    if meter is None:
        return state, inner
    if meter.on_device:
        return None, device_timed_hook(meter, WIRE_DTYPES.get(compression))

    def timed_hook(state, bucket):  # no annotations: DDP compares them with the real classes (not strings)
        start = time.perf_counter()
        nbytes = size(bucket)  # before the hook: PowerSGD advances its iteration counter on the last bucket
        return meter.timed(inner(state, bucket), nbytes, start)

    return state, timed_hook


def device_timed_hook(meter: CommMeter, wire: torch.dtype | None):
    """torch's allreduce_hook (`wire` None) or its fp16/bf16 compression hook, with the all-reduce's Work handed to
    `meter` (torch's hooks return only its future, which on CUDA completes before the collective does)."""
    import torch.distributed as dist

    def hook(group, bucket):
        start = time.perf_counter()
        group = group or dist.group.WORLD
        buffer = bucket.buffer()
        tensor = buffer if wire is None else buffer.to(wire)
        tensor.div_(dist.get_world_size(group))
        work = meter.timed(dist.all_reduce(tensor, group=group, async_op=True), nbytes_of(tensor), start)

        def unpack(future):
            reduced = future.value()[0]
            return reduced if wire is None else buffer.copy_(reduced)

        return work.get_future().then(unpack)

    return hook


def single_bucket_mb(model: torch.nn.Module) -> float:
    """A DDP `bucket_cap_mb` that puts every gradient into one bucket."""
    return sum(nbytes_of(p) for p in model.parameters() if p.requires_grad) / 2**20 + 1.0


# ----------------------------------------------------------------------------------------------
# Timed collectives: FSDP2's all-gather and reduce-scatter (and a context split's gathers, parallel/context.py;
# DeepSpeed's backend: parallel/deepspeed/timed.py)


def timed_call(meter: CommMeter, call, nbytes: int):
    """Run one collective (`call()`) and hand it to `meter`. What it returned says how it ran: a Work (it is
    asynchronous) is timed by its completion, or by nccl on the device; None (it was synchronous) ended on the host
    when the call returned, and on the device is timed by events around the call (which holds the caller's stream
    until the collective is done)."""
    start = time.perf_counter()
    if meter.on_device:
        result, timing = _Timing.around(call)
        meter.timed(result if hasattr(result, "is_completed") else timing, nbytes, start)
        return result
    return meter.timed(call(), nbytes, start)


def fsdp_comms(meter: CommMeter):
    """(all-gather, reduce-scatter, all-reduce hook): FSDP2's default all-gather and reduce-scatter, each call
    recorded by `meter`, and a hook for `set_all_reduce_hook` that records HSDP's all-reduce over the replicate
    groups. FSDP2 issues that one itself (a plain `dist.all_reduce`, no custom collective), right after the
    reduce-scatter, on a stream that waits for it, then calls the hook on that stream: its span is from the
    reduce-scatter's end (host clock, or an event on the reduce-scatter's stream) to the hook. With shards of one
    rank there is no reduce-scatter to start from: its bytes are counted, its time is not (that window's seconds
    are None, not a part passed off as the whole)."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    scattered: list[Any] = [None]  # where the last reduce-scatter ended, until the all-reduce after it reads it

    class TimedAllGather(DefaultAllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            call = functools.partial(super().__call__, output_tensor, input_tensor, group, async_op)
            return timed_call(meter, call, nbytes_of(output_tensor))

    class TimedReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            call = functools.partial(super().__call__, output_tensor, input_tensor, group, op, async_op)
            result = timed_call(meter, call, nbytes_of(input_tensor))
            scattered[0] = _now(meter)
            return result

    def all_reduced(output: torch.Tensor) -> None:
        begin, scattered[0] = scattered[0], None
        if begin is None:
            meter.untimed(nbytes_of(output))
        elif meter.on_device:
            meter.timed(_Timing(begin=begin, end=_now(meter)), nbytes_of(output), 0.0)
        else:
            meter.timed(None, nbytes_of(output), begin)

    return TimedAllGather(), TimedReduceScatter(), all_reduced


def _now(meter: CommMeter) -> Any:
    """This moment: the host's clock, or on the device an event recorded on the current stream (None without
    CUDA, which leaves the collective untimed)."""
    if not meter.on_device:
        return time.perf_counter()
    if not torch.cuda.is_available():
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def reduce_dtype(compression: str) -> torch.dtype | None:
    """The dtype FSDP reduces gradients in for `compression` (None: the default, float32)."""
    return WIRE_DTYPES.get(compression)
