"""The checks of device memory and speed: the memory estimator against the allocator's peak, `cpu_offload`'s saving,
and the MFU of the reference GPT at a size that fills the device."""

from __future__ import annotations

import math
import time

import disttrain.bench.gpu.kit as kit
from disttrain.bench.gpu.kit import MEDIUM, OFFLOAD, Check

MEMORY_TOLERANCE = 0.10
OFFLOAD_TARGET = 0.75
MFU_TARGET = 0.45


def mfu_size(args) -> dict[str, int]:
    return {"n_layer": args.n_layer, "d_model": args.d_model, "n_head": args.n_head, "seq_len": args.seq_len,
            "vocab_size": args.vocab}


def pick_micro_batch(size: dict[str, int], precision: str, budget_bytes: float, strategy: str = "single",
                     limit: int = 256) -> int | None:
    """The largest power-of-two micro-batch (at most `limit`) whose estimated per-rank total fits `budget_bytes`;
    None when not even one sequence does."""
    from disttrain.memory import estimate

    best, micro = None, 1
    while micro <= limit:
        total = estimate(kit.config(size, micro, strategy, precision), 1, strategy).total(False)
        if total is None or total > budget_bytes:
            break
        best, micro = micro, 2 * micro
    return best


def check_memory(args, check: Check, strategy: str, size: dict[str, int] = MEDIUM, micro: int = 4,
                 compiled: bool = False) -> None:
    """The estimate's total against the allocator's peak over the third step, the steady state the estimate counts
    (the first creates optimizer state; in the second DDP rebuilds its buckets and frees the old ones). `compiled`:
    each block compiled (`parallel.compile = "inductor"`), whose graphs save what inductor's partitioner chose; the
    estimate counts what the eager blocks save."""
    import torch

    from disttrain.memory import estimate
    from disttrain.parallel import registry

    if compiled:
        if not args.compile:
            raise kit.Skipped("--no-compile: this check measures compiled blocks")
        torch._dynamo.reset()
    settings = (f"data.global_batch_size={2 * micro}",) + (("parallel.compile=inductor",) if compiled else ())
    cfg = kit.config(size, micro, strategy, "fp32", settings)  # the 2 micro-batches run
    est = estimate(cfg, 1, strategy)
    backend = kit.backend(cfg, kit.runtime(args.device, group=registry.get(strategy).needs_group))
    windows = kit.windows(size["seq_len"])
    meter = getattr(backend.prepared, "comm", None)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] if compiled else 0
    for index in range(2):  # the first creates optimizer state; DDP rebuilds its buckets in the second's forward
        kit.step(backend, windows, index, micro, accumulate=2)
        if meter is not None:  # as the Trainer does after each step (perf.StepMeter): the meter holds the
            meter.take()  # collectives' Works, and with them the buckets they reduced
    if compiled:
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
        check.figures["graphs compiled"] = str(graphs)
        if not graphs:
            raise RuntimeError("parallel.compile made no graph: the blocks ran eagerly")
    torch.cuda.synchronize(args.device)
    torch.cuda.reset_peak_memory_stats(args.device)
    held = torch.cuda.memory_allocated(args.device)
    kit.step(backend, windows, 2, micro, accumulate=2)
    peak = torch.cuda.max_memory_allocated(args.device)
    total = est.total(False)
    ratio = peak / total
    check.figures.update({
        "model": kit.describe(size, micro) + ", fp32, AdamW, 2 micro-batches per step"
                 + (", each block compiled (inductor)" if compiled else ""),
        "estimate: params / grads / optimizer / activations":
            " / ".join(kit.gib(n) for n in (est.params, est.grads, est.optimizer, est.activations)),
        "estimate total": kit.gib(total), "measured peak (max_memory_allocated)": kit.gib(peak),
        "measured / estimate": f"{ratio:.3f}",
        "held between steps (params + optimizer state; under ddp its buckets too) vs the estimate's params + "
        "optimizer state":
            f"{kit.gib(held)} vs {kit.gib(est.params + est.optimizer)}",
        "the step's peak above that (gradients + a micro-batch's activations) vs the estimate's":
            f"{kit.gib(peak - held)} vs {kit.gib(est.grads + est.activations)} "
            f"({(peak - held) / (est.grads + est.activations):.3f})"})
    check.passed = abs(ratio - 1) <= MEMORY_TOLERANCE
    check.reason = f"measured / estimate within 1 +- {MEMORY_TOLERANCE:g}" + ("" if check.passed else
                                                                              f": {ratio:.3f}")
    if compiled:
        torch._dynamo.reset()  # (the checks after it compile graphs of their own)


def check_cpu_offload(args, check: Check, size: dict[str, int] = OFFLOAD, micro: int = 2) -> None:
    import torch

    from disttrain.memory import estimate

    peaks = {}
    windows = kit.windows(size["seq_len"])
    for offload in (False, True):
        cfg = kit.config(size, micro, "fsdp", "fp32", (f"parallel.cpu_offload={str(offload).lower()}",))
        backend = kit.backend(cfg, kit.runtime(args.device, group=True))
        kit.step(backend, windows, 0, micro)
        torch.cuda.synchronize(args.device)
        torch.cuda.reset_peak_memory_stats(args.device)
        kit.step(backend, windows, 1, micro)
        peaks[offload] = torch.cuda.max_memory_allocated(args.device)
        check.figures[f"peak GPU memory of a step, cpu_offload={str(offload).lower()}"] = kit.gib(peaks[offload])
        del backend
        kit.release(args.device)
    est = estimate(kit.config(size, micro, "fsdp", "fp32"), 1, "fsdp")
    states = est.params + est.grads + est.optimizer
    saved = peaks[False] - peaks[True]
    check.figures.update({"model": kit.describe(size, micro) + ", fp32, AdamW",
                          "saved": f"{kit.gib(saved)} of {kit.gib(states)} estimated model states "
                                   f"({saved / states:.0%})"})
    check.passed = saved >= OFFLOAD_TARGET * states
    check.reason = f"saves at least {OFFLOAD_TARGET:.0%} of the model states" + (
        "" if check.passed else f": {saved / states:.0%}")


def check_mfu(args, check: Check, strategy: str = "single", blocks: bool = False) -> None:
    """`blocks`: compiled as a user's job is, each transformer block (`parallel.compile = "inductor"`), not the whole
    model (the embedding, head and loss then run eagerly)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from disttrain.memory import estimate
    from disttrain.perf import flops_per_token, peak_tflops

    if blocks:
        if not args.compile:
            raise kit.Skipped("--no-compile: this check measures compiled blocks")
        import torch._dynamo

        torch._dynamo.reset()  # (the whole-model compiles of the checks before: their graphs are not these)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] if blocks else 0
    device, size, precision = args.device, mfu_size(args), args.mfu_precision
    budget = args.memory_fraction * torch.cuda.get_device_properties(device).total_memory
    micro = args.micro or pick_micro_batch(size, precision, budget, strategy)
    if micro is None:
        raise RuntimeError(f"the model does not fit {kit.gib(budget)} (--memory-fraction {args.memory_fraction}) even "
                           "at micro-batch 1; pass a smaller --n-layer / --d-model / --seq-len")
    from disttrain.parallel import registry

    cfg = kit.config(size, micro, strategy, precision, ("parallel.compile=inductor",) if blocks else ())
    needs_group = registry.get(strategy).needs_group
    backend = kit.backend(cfg, kit.runtime(device, group=needs_group), grad_clip=1.0)  # the Trainer's clip
    flops = flops_per_token(backend.model, args.seq_len)
    peak = args.peak_tflops or peak_tflops(device, precision)
    check.figures.update({"model": kit.describe(size, micro) + f", {strategy}, {precision}, AdamW, grad clip 1.0",
                          "parameters": f"{sum(p.numel() for p in backend.model.parameters()) / 1e9:.3f} B",
                          "training FLOPs per token": f"{flops / 1e9:.2f} GFLOP",
                          "torch.compile": "each block (parallel.compile)" if blocks else str(args.compile),
                          "attention": "SDPA, flash attention forced",
                          "estimate total": kit.gib(estimate(cfg, 1, strategy).total(False))})
    if args.compile and not blocks:
        backend.model.compile()  # in place: the module keeps its class, names and forward signature
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(args.vocab, (micro, args.seq_len + 1), generator=gen)
    batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # raises where flash attention cannot run, rather than falling back
        start = time.perf_counter()
        for _ in range(3):  # the first compiles forward and backward
            backend.forward_backward(batch)
            backend.optim_step()
        check.figures["warm-up (3 steps, compilation included)"] = f"{time.perf_counter() - start:.1f} s"
        if blocks:
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
            check.figures["graphs compiled"] = str(graphs)
            if not graphs:
                raise RuntimeError("parallel.compile made no graph: the blocks ran eagerly")
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        for _ in range(args.steps):
            backend.forward_backward(batch)
            out = backend.optim_step()
        torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
    tokens_per_s = args.steps * micro * args.seq_len / elapsed
    tflops = flops * tokens_per_s / 1e12
    check.figures.update({"step time": kit.ms(elapsed / args.steps), "tokens/s": f"{tokens_per_s:,.0f}",
                          "achieved TFLOP/s": f"{tflops:.1f}",
                          "peak TFLOP/s": f"{peak:g}" if peak else "unknown for this device (pass --peak-tflops)",
                          "peak memory (max_memory_allocated)": kit.gib(torch.cuda.max_memory_allocated(device)),
                          "last loss": f"{out['loss']:.4f}"})
    if not peak:
        raise RuntimeError(f"no peak TFLOP/s known for {torch.cuda.get_device_name(device)}; pass --peak-tflops")
    mfu = tflops / peak
    check.figures["MFU"] = f"{mfu:.1%}"
    check.passed = mfu >= MFU_TARGET and math.isfinite(out["loss"])
    check.reason = f"MFU >= {MFU_TARGET:.0%}" + ("" if check.passed else f": {mfu:.1%}")
