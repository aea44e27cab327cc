"""The checks of a step on CUDA: nccl at world size 1, the precisions' steps, the queued step, and an fsdp
checkpoint's async save and exact resume."""

from __future__ import annotations

import copy
import datetime
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import disttrain.bench.gpu.kit as kit
from disttrain.bench.gpu.kit import MEDIUM, SMALL, Check


def check_nccl(args, check: Check) -> None:
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("a process group already exists in this process; the nccl check forms its own")
    device = args.device
    # torch's flight recorder, as init_runtime turns it on for every job (monitor.py reads it when a job hangs)
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        store = dist.FileStore(str(Path(tmp) / "store"), 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=device,
                                timeout=datetime.timedelta(seconds=120))
        try:
            x = torch.full((2**24,), 1.5, device=device)  # 64 MiB of float32
            dist.all_reduce(x)
            torch.cuda.synchronize(device)
            check.figures["init_process_group + first all_reduce"] = kit.ms(time.perf_counter() - start)
            times = []
            for _ in range(10):
                t = time.perf_counter()
                dist.all_reduce(x)
                torch.cuda.synchronize(device)
                times.append(time.perf_counter() - t)
            check.figures["all_reduce of 64 MiB, median of 10"] = kit.ms(statistics.median(times))
            t = time.perf_counter()
            dist.barrier(device_ids=[device.index])
            torch.cuda.synchronize(device)
            check.figures["barrier"] = kit.ms(time.perf_counter() - t)
            backend, unchanged = dist.get_backend(), bool(torch.all(x == 1.5))
            check.figures["backend"] = backend
            from disttrain.monitor import collective_records

            records = collective_records()
            entries = records.get("entries") or []
            last = entries[-1].get("profiling_name") if entries else None
            check.figures["flight recorder"] = (f"{len(entries)} record(s), the last {last}" if entries
                                                else records.get("note", "no records"))
        finally:
            dist.destroy_process_group()
    check.passed = backend == "nccl" and unchanged
    check.reason = "a one-rank all_reduce leaves the tensor as it was" if unchanged else \
        "the one-rank all_reduce changed the tensor (its sum over one rank must equal it)"


def check_steps(args, check: Check, precision: str, size: dict[str, int] = SMALL, steps: int = 40,
                micro: int = 8) -> None:
    """`steps` optimizer steps of a small GPT on fresh batches: every loss finite, the last five below the first."""
    cfg = kit.config(size, micro, "single", precision, ("optim.lr=0.001",))
    backend = kit.backend(cfg, kit.runtime(args.device, group=False))
    windows = kit.windows(size["seq_len"])
    losses, times, out = [], [], {}
    for index in range(steps):
        start = time.perf_counter()
        out = kit.step(backend, windows, index, micro)
        times.append(time.perf_counter() - start)
        losses.append(out["loss"])
    finite, first, last = all(map(math.isfinite, losses)), losses[0], statistics.mean(losses[-5:])
    check.figures.update({"model": kit.describe(size, micro), "first loss": f"{first:.4f}",
                          "mean of the last 5 losses": f"{last:.4f}",
                          "step time, median after 5": kit.ms(statistics.median(times[5:] or times)),
                          "skipped steps": str(out["skipped_steps"])})
    if "loss_scale" in out:
        check.figures["final loss scale"] = f"{out['loss_scale']:g}"
    check.passed = finite and last < first - 0.5 and out["skipped_steps"] < steps // 2
    check.reason = ("finite losses, the last 5 at least 0.5 below the first, under half the steps skipped"
                    if check.passed else
                    "non-finite loss" if not finite else f"losses did not fall ({first:.4f} -> {last:.4f}) "
                    f"or too many skipped steps ({out['skipped_steps']} of {steps})")


def _syncs(step: Callable[[], None], steps: int) -> tuple[float, list[str]]:
    """The host's waits for the device per step, as CUDA's sync debug mode reports them (each one a warning from the
    Python line that asked), and where they came from."""
    import warnings

    import torch

    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                step()
        finally:
            torch.cuda.set_sync_debug_mode(before)
    seen = [w for w in caught if "synchroniz" in str(w.message)]
    return len(seen) / steps, sorted({f"{Path(w.filename).name}:{w.lineno}" for w in seen})


def check_queued_step(args, check: Check, strategies: tuple[str, ...] = ("ddp", "fsdp"),
                      size: dict[str, int] = SMALL, micro: int = 8, clip: float = 0.1) -> None:
    """The optimizer step queued whole on the device (docs/architecture.md, "The queued step") on CUDA: under fused
    AdamW it updates as the step that reads the device first, bit for bit, with the clip at work; it waits for the
    device once per step; a refused step (a NaN loss; NaN gradients with a finite loss) leaves the parameters and
    the optimizer's state as they were; and a state saved by a foreach AdamW (as under DeepSpeed) loads into the
    fused one with its step counts on the device, where torch's CUDA kernel reads them unchecked."""
    import torch

    from disttrain.batches import to_device
    from disttrain.parallel import registry

    device, results = args.device, []
    windows = kit.windows(size["seq_len"])
    batches = [to_device(kit.batch(windows, i, micro), device) for i in range(12)]

    def step(backend, index: int) -> dict:
        backend.forward_backward(batches[index], values=False)  # (as the Trainer: no read of the micro-batch's loss)
        return backend.optim_step()

    def next_step(backend) -> dict:  # batches 3, 4, 5 (its steps 4-6)
        return step(backend, 3 + backend.step % 3)

    def foreach(model):  # what a DeepSpeed or foreach run saves: step counts on the host
        return torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)

    def fused(model):
        return torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    for strategy in strategies:
        cfg = kit.config(size, micro, strategy, "fp32", ("optim.lr=0.001",))
        runtime = kit.runtime(device, group=registry.get(strategy).needs_group)
        queued, read = (kit.backend(cfg, runtime, grad_clip=clip) for _ in range(2))
        on_device = queued.prepared.steps_on_device(device)
        read.prepared.steps_on_device = lambda device: False
        outs = {name: [(o["loss"], o["grad_norm"], o["skipped"]) for o in (step(b, i) for i in range(3))]
                for name, b in (("queued", queued), ("read", read))}
        same = outs["queued"] == outs["read"] and kit.equal(kit.state(queued), kit.state(read))
        clipped = all(norm > clip for _, norm, _ in outs["read"])
        check.figures[f"{strategy}: queued whole / same as the step that reads first, bit for bit / clip at work"] = (
            f"{on_device} / {same} / {clipped}")
        syncs_ok = True
        if device.type == "cuda":
            per_step, where = _syncs(partial(next_step, queued), 3)
            read_per_step, _ = _syncs(partial(next_step, read), 3)
            check.figures[f"{strategy}: host waits per step, queued / reads first"] = (
                f"{per_step:g} / {read_per_step:g} (from {', '.join(where) or 'nowhere'})")
            syncs_ok = per_step <= 1
        refusals = []
        for bad in ("loss", "gradient"):
            backend = kit.backend(cfg, runtime, grad_clip=clip, on_nonfinite="skip")
            step(backend, 0)
            before = kit.state(backend)
            # NaN loss; or a loss of 0 whose gradient is NaN (sqrt's slope at 0 is inf, times the mean's 0)
            loss_fn = ((lambda out, batch: out.float().mean() * float("nan")) if bad == "loss" else
                       (lambda out, batch: (out.float().mean() * 0.0).sqrt()))
            backend.forward_backward(batches[1], loss_fn=loss_fn)
            out = backend.optim_step()
            refusals.append(out["skipped"] and kit.equal(before, kit.state(backend)))
        check.figures[f"{strategy}: a refused step (NaN loss / NaN gradients) leaves the state as it was"] = (
            " / ".join(map(str, refusals)))
        saved = kit.backend(cfg, runtime, factory=foreach)
        for i in range(2):
            step(saved, i)
        loaded = kit.backend(cfg, runtime, factory=fused)
        loaded.load_state_dict(copy.deepcopy(saved.state_dict()))  # (both go on: neither may hold the other's)
        from disttrain.parallel.state import local_tensor

        steps_placed = all(
            s["step"].device == local_tensor(p).device
            and s["step"].dtype == torch.float32 for p, s in loaded.optimizer.state.items())
        step(saved, 2)
        step(loaded, 2)
        difference = kit.max_difference(kit.state(saved), kit.state(loaded))
        resumed_queued = loaded.prepared.steps_on_device(device)
        check.figures[f"{strategy}: foreach state loaded into fused AdamW: step counts on the device / queued / "
                      "next step's largest difference from foreach's"] = (
            f"{steps_placed} / {resumed_queued} / {difference:.2e}")
        results.append(on_device and same and clipped and syncs_ok and all(refusals) and steps_placed
                       and resumed_queued and difference < 1e-5)
        del queued, read, backend, saved, loaded
        kit.release(device)
    check.figures["model"] = kit.describe(size, micro) + f", fp32, fused AdamW, grad_clip {clip}"
    check.passed = all(results)
    check.reason = ("queued and read-first steps equal bit for bit, one host wait per step (CUDA), refused steps "
                    "change nothing, a foreach state resumes in the fused step within 1e-5" if check.passed else
                    "failed for " + ", ".join(s for s, ok in zip(strategies, results, strict=True) if not ok)
                    + " (the figures say which part)")


def check_checkpoint(args, check: Check, size: dict[str, int] = MEDIUM, micro: int = 4, steps: int = 3) -> None:
    """An fsdp checkpoint saved as the Trainer saves it (async, the copy deferred to the background thread) over the
    one-rank nccl group: the staged copy stays in host memory (the device's allocated bytes grow by less than a tenth
    of the state; staged back onto a GPU, as `DTensor.from_local` did, they would grow by all of it), and a fresh
    backend that loads it holds the same parameters and optimizer state, bit for bit, and takes the same next step.
    (On a CPU, as the tests run it, the memory is not measured.)"""
    import tempfile

    import torch

    from disttrain.checkpoint import CheckpointManager
    from disttrain.config import CheckpointConfig

    cfg = kit.config(size, micro, "fsdp", "bf16-mixed")
    runtime = kit.runtime(args.device, group=True)
    backend = kit.backend(cfg, runtime)
    windows = kit.windows(size["seq_len"])
    for index in range(steps):
        kit.step(backend, windows, index, micro)
    state_bytes = sum(t.numel() * t.element_size() for t in kit.state(backend))
    cuda = args.device.type == "cuda"

    def allocated() -> int:
        if not cuda:
            return 0
        torch.cuda.synchronize(args.device)
        return torch.cuda.memory_allocated(args.device)

    with tempfile.TemporaryDirectory() as folder:
        manager = CheckpointManager(folder, CheckpointConfig(async_save=True), runtime)
        before = allocated()
        manager.save(steps, backend.state_dict(), defer_copy=True)
        manager.wait_for_copy()
        grown = allocated() - before
        manager.wait()
        fresh = kit.backend(cfg, runtime)
        fresh.load_state_dict(manager.load("latest", target=fresh.prepared.checkpoint_target))
    same = kit.equal(kit.state(backend), kit.state(fresh))
    saved_next, loaded_next = (kit.step(b, windows, steps, micro)["loss"] for b in (backend, fresh))
    check.figures.update({"model": kit.describe(size, micro) + ", bf16-mixed, fsdp, async save (copy deferred)",
                          "state (parameters and optimizer, this rank)": kit.gib(state_bytes),
                          "device memory grown while the copy was staged": kit.gib(grown) if cuda else "n/a (CPU)",
                          "loaded state": "equal bit for bit" if same else "DIFFERENT",
                          "next step's loss, saved / loaded": f"{saved_next!r} / {loaded_next!r}"})
    check.passed = grown < 0.1 * state_bytes and same and saved_next == loaded_next
    check.reason = ("staged on the host, resumed bit for bit" if check.passed else
                    f"grew {kit.gib(grown)} of {kit.gib(state_bytes)}, state equal {same}, losses {saved_next} / "
                    f"{loaded_next}")
