"""The checks of models split across ranks and of the TrainingService on CUDA: the tensor-parallel plan and the pipeline
schedules on a one-rank nccl mesh against the plain model, and two Ray services sharing the GPU by fractions."""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import tempfile
import time

import disttrain.bench.gpu.kit as kit
from disttrain.bench.gpu.kit import SMALL, Check, Skipped

PARITY = 1e-5  # fp32 losses of a split model against one process's


def _split_backend(cfg, runtime, tensor_parallel: bool, schedule: str):
    """The reference GPT split as compose.prepare splits it on a pp/tp layout, over a one-rank DeviceMesh (every
    axis of size 1): the tensor-parallel plan (sequence parallel; loss parallel without a pipeline), and
    `schedule`'s pipeline stages ("": none), both on this one rank for the virtual and V-shaped schedules. torch's
    DTensor and pipelining engines run as on many ranks; only the collectives are trivial. (compose.prepare does
    this from a layout, which at world size 1 splits nothing.)"""
    import torch

    from disttrain.backend import TrainingBackend
    from disttrain.models.gpt import GPT
    from disttrain.optim import optimizer_factory
    from disttrain.parallel import mesh, pipeline, tensor
    from disttrain.parallel.spec import Prepared
    from disttrain.parallel.state import dtensor_targets, full_state_dict_fns
    from disttrain.precision import get_precision

    torch.manual_seed(0)
    with torch.device(runtime.device):
        model = GPT(cfg.model)
    device_mesh = mesh.device_mesh(mesh.MeshLayout(), runtime.device.type)
    if tensor_parallel:
        tensor.parallelize(model, device_mesh["tp"], sequence_parallel=True, split_logits=not schedule)
    if schedule:
        parallel = dataclasses.replace(cfg.parallel, pipeline_schedule=schedule)
        prepared = pipeline.prepare(model, runtime, parallel, device_mesh, None, torch.float32)
    else:
        prepared = Prepared(module=model, model=model, checkpoint_target=dtensor_targets(model),
                            **full_state_dict_fns(model, sharded=True))
        prepared.split_logits = tensor.LossParallel()
    prepared.data_parallel, prepared.counts_loss = (1, 0), True
    prepared.build_optimizer(optimizer_factory(cfg.optim))
    return TrainingBackend(prepared, runtime, get_precision("fp32"), strategy="single")


def check_split(args, check: Check, tensor_parallel: bool, schedule: str = "", size: dict[str, int] = SMALL,
                micro: int = 4, accumulate: int = 4, steps: int = 5) -> None:
    """The tensor-parallel and pipeline engines on one device (nccl at world size 1; `_split_backend`) against the
    plain model, fp32, the same batches: the losses of `steps` steps of `accumulate` micro-batches each (a
    pipeline's micro-batches) within PARITY."""
    import torch

    cfg = kit.config(size, micro, "single", "fp32", ("optim.lr=0.001",))
    windows = kit.windows(size["seq_len"])
    losses, times = {}, {}
    for name in ("single", "split"):
        backend = (kit.backend(cfg, kit.runtime(args.device, group=False)) if name == "single" else
                   _split_backend(cfg, kit.runtime(args.device, group=True), tensor_parallel, schedule))
        losses[name], times[name] = [], []
        for index in range(steps):
            start = time.perf_counter()
            losses[name].append(kit.step(backend, windows, index, micro, accumulate)["loss"])
            times[name].append(time.perf_counter() - start)
        if name == "split":
            prepared = backend.prepared
            check.figures["backend"] = torch.distributed.get_backend()
            check.figures["parameters that are DTensors"] = str(sum(hasattr(p, "placements")
                                                                    for p in backend.model.parameters()))
            if schedule:
                check.figures["stages on this rank"] = (f"{[s for s, _ in prepared.parts]} of "
                                                        f"{prepared.layout.stages}")
        del backend
        kit.release(args.device)
    worst = max(abs(a - b) for a, b in zip(losses["single"], losses["split"], strict=True))
    check.figures.update({
        "model": kit.describe(size, micro) + f", fp32, {accumulate} micro-batches per step",
        "losses, one process": " ".join(f"{x:.6f}" for x in losses["single"]),
        "losses, split": " ".join(f"{x:.6f}" for x in losses["split"]),
        "max abs loss difference": f"{worst:.2e}",
        "step time after the first, one process / split": " / ".join(
            kit.ms(statistics.median(times[n][1:])) for n in ("single", "split"))})
    check.passed = worst <= PARITY and all(map(math.isfinite, losses["split"]))
    check.reason = f"losses equal to one process's within {PARITY:g} over {steps} steps" + (
        "" if check.passed else f": {worst:.2e}")


def check_service(args, check: Check, size: dict[str, int] = SMALL, micro: int = 8, steps: int = 20) -> None:
    """Two TrainingServices on Ray sharing this one GPU by fractions (training 0.5, rollout 0.25), each its own
    placement group: the training one trains `steps` steps on the device Ray gave it; the rollout one is placed."""
    import asyncio

    try:
        import ray
    except ImportError:
        raise Skipped("ray is not installed (disttrain[ray])") from None
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    with tempfile.TemporaryDirectory(prefix="dtray", dir="/tmp") as tmp:  # Ray's socket paths must be short
        ray.init(num_cpus=4, include_dashboard=False, _temp_dir=tmp, configure_logging=False)
        try:
            check.figures["ray"] = f"{ray.__version__}, GPUs in the cluster: {ray.cluster_resources().get('GPU', 0):g}"
            asyncio.run(_fractional_services(check, size, micro, steps))
        finally:
            ray.shutdown()


async def _fractional_services(check: Check, size: dict[str, int], micro: int, steps: int) -> None:
    from disttrain.service import TrainingService

    def options(gpus: float):
        return TrainingService.options(nproc=1, launcher="ray", gpus_per_worker=gpus)

    model = dict(size)
    training = await options(0.5).as_service("gpt", model_args=model, strategy="fsdp", precision="bf16-mixed",
                                             optimizer={"lr": 1e-3, "warmup_steps": 0})
    try:
        rollout = await options(0.25).as_service("gpt", model_args=model)
        try:
            windows, losses = kit.windows(size["seq_len"]), []
            start = time.perf_counter()
            for index in range(steps):
                await training.forward_backward(kit.batch(windows, index, micro))
                losses.append((await training.optim_step())["loss"])
            elapsed = time.perf_counter() - start
            status = [await service.status() for service in (training, rollout)]
        finally:
            await rollout.shutdown()
    finally:
        await training.shutdown()
    devices = [s["devices"] for s in status]
    gpus = [[w.get("gpus") for w in s["workers"]] for s in status]
    first, last = losses[0], statistics.mean(losses[-5:])
    check.figures.update({"training service": f"1 x 0.5 GPU, fsdp, bf16-mixed, {kit.describe(size, micro)}",
                          "rollout service": "1 x 0.25 GPU", "devices (training, rollout)": str(devices),
                          "GPU ids Ray gave (training, rollout)": str(gpus),
                          "losses": f"{first:.4f} -> {last:.4f} (mean of the last 5) over {steps} steps",
                          "seconds per step (driver round trips included)": f"{elapsed / steps:.3f}"})
    on_gpu = all(d.startswith("cuda") for group in devices for d in group)
    shared = len({ids[0] for group in gpus for ids in group if len(ids) == 1}) == 1  # one GPU id, both services
    check.passed = on_gpu and shared and all(len(ids) == 1 for group in gpus for ids in group) and last < first - 0.5
    check.reason = ("both services on the GPU Ray assigned (fractions of one device), the training one learns"
                    if check.passed else f"devices {devices}, GPU ids {gpus}, losses {first:.4f} -> {last:.4f}")
