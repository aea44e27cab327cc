"""What a step costs, measured in every run: model FLOPs and MFU, communication time, peak memory per rank, and the
slowest rank. The Trainer adds these to each `metrics.jsonl` line (docs/architecture.md, "The cost of scale").

    tflops          achieved model TFLOP/s per device: flops_per_token x tokens/s / world size
    mfu             tflops / the device's peak (`log.peak_tflops`, or the table below); null where the peak is unknown
    comm_s          seconds this rank's gradient/parameter collectives were in flight during the step (parallel/comm.py)
                    (on CUDA: nccl's own device timing of each collective, summed)
    comm_exposed_s  the part of it the step waited for: on a CPU rank (one torch thread, gloo's own threads do the
                    communication) the time the training thread was blocked, wall time - its CPU time, capped at
                    comm_s; the rest overlapped compute. Null on CUDA per step; the steps of `log.profile_steps`
                    get it, and comm_hidden_s, from their trace's kernels (`comm_overlap`: profile/rank<R>_comm.json)
    comm_bytes      bytes handed to those collectives (nccl-tests' sizes), in the dtype on the wire
    mem_peak_gib    this rank's peak memory since the previous line: CUDA max allocated, or the process's peak
                    resident set (Linux: VmHWM, reset after each reading)
    waited_s        the time this rank spent in its collectives per step, the mean over the steps since the
                    previous line: comm_exposed_s on a CPU rank; on CUDA comm_s (nccl's kernels of a rank that comes
                    first spin until the last one does, and run alongside compute where they overlap it); 0 where
                    nothing is measured
    work_s          the step's time less waited_s (the same mean). In synchronous training every rank's step takes
                    as long as the slowest one's, so step times cannot tell a straggler; work can
    *_max           step_time_s, mem_peak_gib, comm_exposed_s over all ranks
    slowest_rank    the rank with the most work, each counted with the least waited_s of any rank added back (what
                    every rank spends in collectives alike is nobody's straggling), and slowest_ratio its work / the
                    median of the other ranks' (the progress line names it from 1.2); one all-gather of five numbers
                    per logged line. Collectives the meter does not see (a pipeline's sends, tensor parallelism's
                    activation collectives) count as work: there a straggler is not told

The measurement costs a few clock reads per step and one small all-gather per logged line (`bench overhead`
measures it against a hand-written loop).
"""

from __future__ import annotations

import contextlib
import math
import re
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from disttrain.parallel.activation_checkpoint import transformer_blocks
from disttrain.parallel.comm import merge_intervals

# Dense peak TFLOP/s of one device by the dtype its matmuls run in (vendor data sheets, without sparsity).
# Matched against torch.cuda.get_device_name() in this order: the first key found in the name that no letter or
# digit follows ("L4" is not the "NVIDIA L40"; "H200" is the "NVIDIA GH200 480GB"'s GPU).
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0}),
    ("H100 NVL", {"bf16": 835.0, "fp16": 835.0, "tf32": 418.0, "fp32": 60.0}),
    ("H100", {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0}),  # SXM
    ("H200", {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0}),
    ("B200", {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 75.0}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6}),
    ("L40", {"bf16": 181.0, "fp16": 181.0, "tf32": 90.5, "fp32": 90.5}),
    ("L4", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
)


def peak_tflops(device: torch.device, precision: str) -> float | None:
    """The table's dense peak for `device` in `precision`'s matmul dtype; None on a CPU or an unknown device."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    dtype = {"bf16-mixed": "bf16", "bf16-true": "bf16", "fp16-mixed": "fp16"}.get(precision)
    if dtype is None:  # fp32: TensorFloat-32 matmuls when torch allows them
        dtype = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"
    return peak_for_name(name, dtype)


def peak_for_name(name: str, dtype: str) -> float | None:
    """The table's dense peak in `dtype` ("bf16", "fp16", "tf32", "fp32") for a device named `name`, or None."""
    for key, peaks in PEAK_TFLOPS:
        if re.search(re.escape(key) + r"(?![0-9A-Za-z])", name):
            return peaks[dtype]
    return None


def _numel(param: torch.Tensor) -> int:
    return int(getattr(param, "ds_numel", 0) or param.numel())  # a DeepSpeed ZeRO-3 partition keeps its size there


def _shape(model: nn.Module) -> tuple[int, int] | None:
    """(layers, attention width) of a transformer, from the reference GPT's or a Hugging Face model's config."""
    cfg = getattr(model, "config", None) or getattr(model, "cfg", None)
    layers = next((getattr(cfg, k) for k in ("num_hidden_layers", "n_layer", "num_layers") if hasattr(cfg, k)), None)
    heads = getattr(cfg, "num_attention_heads", None)
    head_dim = getattr(cfg, "head_dim", None)
    width = heads * head_dim if heads and head_dim else next(
        (getattr(cfg, k) for k in ("hidden_size", "d_model", "n_embd") if hasattr(cfg, k)), None)
    return (int(layers), int(width)) if layers and width else None


def key_width(model: nn.Module) -> int:
    """Width of one layer's keys (and values) of a transformer: its key-value heads x head size (grouped-query
    attention's fewer heads), from its config as `_shape` reads it; 0 where not known."""
    shape = _shape(model)
    cfg = getattr(model, "config", None) or getattr(model, "cfg", None)
    heads, kv_heads = getattr(cfg, "num_attention_heads", None), getattr(cfg, "num_key_value_heads", None)
    if not shape:
        return 0
    return shape[1] * kv_heads // heads if heads and kv_heads else shape[1]


def flops_per_token(model: nn.Module, seq_len: int) -> int:
    """Training FLOPs per token (forward + backward): 6 x the parameters that multiply activations, plus the
    attention scores and their weighted sum, 12 x layers x attention width x sequence length (PaLM's count, as
    torchtitan reports MFU; causal masking is not discounted). The sum of `flops_by_unit`, which says how."""
    return sum(forward + backward for forward, backward in flops_by_unit(model, seq_len))


def flops_by_unit(model: nn.Module, seq_len: int) -> list[tuple[int, int]]:
    """(forward, backward) training FLOPs per token of each of the model's FSDP units: what is outside the
    transformer blocks (embeddings, final norm, head) first, then each block.

    Parameters are counted from the module tree: every parameter except those only an `nn.Embedding` uses (a table
    lookup is not a matmul); an embedding tied to the output head counts once. Models without a transformer config
    get the parameters term only.

    With frozen parameters (model.freeze), the modules are walked in registration order (forward order for the
    reference GPT and Hugging Face decoders, but for the modules inside a transformer block): a parameter's matmul
    costs 2 (forward) + 2 (its input's gradient, where a trained parameter upstream, or in its block, needs it) + 2
    (its own gradient, where it trains); a layer's attention 4 x width x sequence forward, 8 more where a gradient
    flows through the layer. Exact for whole frozen blocks, else an upper bound. With every parameter trained, every
    input's gradient is counted, as PaLM's count does."""
    shape = _shape(model)
    blocks = transformer_blocks(model)
    layer_of = {id(m): i for i, block in enumerate(blocks) for m in block.modules()}
    trains = [any(p.requires_grad for p in block.parameters()) for block in blocks]
    counted: set[int] = set()
    flows = all(p.requires_grad for p in model.parameters())  # a gradient passes back through what follows
    backward: set[int] = set()  # the layers a gradient flows through
    forward_flops, backward_flops = [0] * (len(blocks) + 1), [0] * (len(blocks) + 1)
    for module in model.modules():
        layer = layer_of.get(id(module))
        unit = 0 if layer is None else layer + 1
        flows = flows or (layer is not None and trains[layer])  # (a block's own order may not be its forward's)
        for param in module.parameters(recurse=False):
            if not isinstance(module, nn.Embedding) and id(param) not in counted:  # (a lookup is not a matmul)
                counted.add(id(param))
                forward_flops[unit] += 2 * _numel(param)
                backward_flops[unit] += (2 * flows + 2 * param.requires_grad) * _numel(param)
            flows = flows or param.requires_grad
        if flows and layer is not None:
            backward.add(layer)
    if shape and len(blocks) == shape[0]:
        for layer in range(len(blocks)):
            forward_flops[layer + 1] += 4 * shape[1] * seq_len
            backward_flops[layer + 1] += 8 * shape[1] * seq_len * (layer in backward)
    elif shape:  # (the blocks found are not the layers, a mixture of experts' list: attention counted in the root)
        forward_flops[0] += 4 * shape[0] * shape[1] * seq_len
        backward_flops[0] += 8 * shape[0] * shape[1] * seq_len
    return list(zip(forward_flops, backward_flops, strict=True))


def peak_memory_gib(device: torch.device) -> float:
    """This process's peak memory since the previous call, then reset: CUDA max allocated on a GPU; on a CPU the
    peak resident set (Linux `VmHWM`, reset through /proc/self/clear_refs; elsewhere the lifetime peak)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak / 2**30
    try:
        status = Path("/proc/self/status").read_text()
        kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:"))
        Path("/proc/self/clear_refs").write_text("5")  # "5": reset the peak to the current resident set
        return kib / 2**20
    except (OSError, StopIteration, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class StepMeter:
    """Times one rank's steps and turns them into the figures above."""

    def __init__(self, flops: int, world: int, device: torch.device, precision: str, peak_override: float = 0.0,
                 comm: Any = None):
        self.flops_per_token = flops
        """The whole model's training FLOPs per token (`flops_per_token`, counted before a strategy splits it: a
        pipeline stage holds a part of it; every rank's share of the work is the whole's / the world size)."""
        self.peak = peak_override or peak_tflops(device, precision)
        self.world, self.device, self.comm = world, device, comm
        self._wall = self._cpu = 0.0
        self._step_sum, self._waited_sum, self._steps = 0.0, 0.0, 0  # since the last logged line

    def start(self) -> None:
        if self.comm is not None:
            self.comm.take()  # forget collectives between steps (evaluation's all-gathers, checkpoint gathers)
        self._wall, self._cpu = time.perf_counter(), time.thread_time()

    def stop(self, tokens: float) -> dict[str, Any]:
        """Figures of the step since `start()`; `tokens` is the global number of tokens it trained on."""
        elapsed = time.perf_counter() - self._wall
        blocked = max(0.0, elapsed - (time.thread_time() - self._cpu))
        tokens_per_s = tokens / elapsed
        tflops = self.flops_per_token * tokens_per_s / self.world / 1e12
        out: dict[str, Any] = {"tokens_per_s": tokens_per_s, "step_time_s": elapsed, "tflops": tflops,
                               "mfu": tflops / self.peak if self.peak else None}
        if self.comm is None:
            out.update(comm_s=None, comm_exposed_s=None, comm_bytes=None)
        else:
            comm_s, nbytes = self.comm.take()
            host_timed = comm_s is not None and not self.comm.on_device  # its intervals lie on the host's clock
            exposed = min(comm_s, blocked) if host_timed else None
            out.update(comm_s=comm_s, comm_exposed_s=exposed, comm_bytes=nbytes)
        waited = out["comm_exposed_s"] if out["comm_exposed_s"] is not None else out["comm_s"] or 0.0
        self._step_sum += elapsed
        self._waited_sum += waited
        self._steps += 1
        return out

    def line(self) -> dict[str, float]:
        """For a logged line: `waited_s` and `work_s`, means over the steps since the previous line (one step's are
        noisy where steps are short), then counted afresh; {} when no step ran since."""
        if not self._steps:
            return {}
        waited = self._waited_sum / self._steps
        out = {"work_s": self._step_sum / self._steps - waited, "waited_s": waited}
        self._step_sum, self._waited_sum, self._steps = 0.0, 0.0, 0
        return out


def rank_summary(values: dict[str, Any], device: torch.device, distributed: bool) -> dict[str, Any]:
    """This rank's peak memory; over all ranks the longest step, the largest peak and exposed communication, and the
    straggler (`slowest`) from each rank's `work_s` and `waited_s` (a collective: every rank calls it at the same
    steps)."""
    exposed = values.get("comm_exposed_s")  # None where not measured (CUDA): NaN on the wire, None again after
    step = values["step_time_s"]
    mine = [step, peak_memory_gib(device), math.nan if exposed is None else exposed, values.get("work_s", step),
            values.get("waited_s", 0.0)]
    rows = [mine]
    if distributed and dist.get_world_size() > 1:  # (a one-rank group: nothing to gather, no device round trip)
        local = torch.tensor(mine, dtype=torch.float64, device=device)
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, local)
        rows = [t.tolist() for t in gathered]
    rank, ratio = slowest([r[3] for r in rows], [r[4] for r in rows])
    return {"mem_peak_gib": mine[1], "mem_peak_gib_max": max(r[1] for r in rows),
            "step_time_max_s": max(r[0] for r in rows), "slowest_rank": rank, "slowest_ratio": ratio,
            "comm_exposed_s_max": max((r[2] for r in rows if not math.isnan(r[2])), default=None)}


def slowest(work: list[float], waited: list[float]) -> tuple[int, float]:
    """(the rank that did the most work, its work / the median of the other ranks'). Each rank's work is counted
    with the least wait of any rank added back: the time every rank spends in collectives alike (data on the wire,
    and, where a device times them, collectives that overlapped compute) is nobody's straggling, and only what a
    rank waited beyond the rank that waited least is the others' lateness."""
    least = min(waited)
    adjusted = [w + least for w in work]
    rank = max(range(len(adjusted)), key=adjusted.__getitem__)
    others = [a for i, a in enumerate(adjusted) if i != rank]
    median = statistics.median(others) if others else adjusted[rank]
    return rank, adjusted[rank] / median if median > 0 and math.isfinite(median) else 1.0


def straggler(values: dict[str, Any], factor: float = 1.2) -> str:
    """'rank R 1.4x' when the rank with the most work per step did at least `factor` x the median of the others'
    (`slowest_ratio`), else ''."""
    ratio = values.get("slowest_ratio")
    if ratio is None or not math.isfinite(ratio) or ratio < factor:
        return ""
    return f"rank {values['slowest_rank']} {ratio:.1f}x"


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the intersection of two merged interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def comm_overlap(trace: dict, steps: int) -> dict[str, float] | None:
    """Per step of a profiled span, from its accelerator kernels (a torch.profiler Chrome trace): `comm_s`, the
    time nccl kernels ran (the union of their intervals), and `comm_exposed_s`, the part of it with no other kernel
    running on the device (the collective was waited for; as Holistic Trace Analysis defines exposed communication),
    both averaged over `steps`; `comm_hidden_s` the rest, and the kernels counted. The span is the steps' whole
    iterations: an evaluation, checkpoint or metrics gather inside them counts too. None when the trace has no
    kernels (a CPU run: there the step meter measures exposure itself)."""
    kernels = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") == "kernel"]
    if not kernels:
        return None
    spans = {True: [], False: []}
    for e in kernels:
        spans[str(e.get("name", "")).lower().startswith("nccl")].append((float(e["ts"]), float(e["ts"]) + e["dur"]))
    comm, compute = merge_intervals(spans[True]), merge_intervals(spans[False])
    comm_us = sum(end - start for start, end in comm)
    exposed_us = comm_us - _overlap(comm, compute)
    return {"steps": steps, "comm_s": comm_us / 1e6 / steps, "comm_exposed_s": exposed_us / 1e6 / steps,
            "comm_hidden_s": (comm_us - exposed_us) / 1e6 / steps, "kernels": len(kernels),
            "collective_kernels": len(spans[True])}


class StepProfiler:
    """`log.profile_steps`: a torch.profiler trace of steps FIRST..LAST, written by each rank to
    `RUN_DIR/profile/rank<R>.json` (Chrome trace format: Perfetto, chrome://tracing). On an accelerator the
    collectives' device time per step, exposed and hidden (`comm_overlap`), goes to `rank<R>_comm.json` beside it
    and rank 0 prints it: the exposure the per-step figures cannot measure there."""

    def __init__(self, span: tuple[int, int] | None, run_dir: Path, rank: int, device: torch.device):
        self.span, self.path, self.device = span, Path(run_dir) / "profile" / f"rank{rank}.json", device
        self.rank = rank
        self._profile, self._steps = None, 0

    def __enter__(self) -> StepProfiler:
        return self

    def __exit__(self, *exc) -> None:
        self.close()  # also when the run ends inside the span

    @contextlib.contextmanager
    def step(self, step: int):
        """Profile the body when `step` lies in the span (the trace is written after its last step)."""
        if self.span and step == self.span[0]:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            # one cycle, no schedule: acc_events only quiets torch's warning that a cycle's end clears them (2.11, CUDA)
            self._profile, self._steps = profile(activities=activities, acc_events=True), 0
            self._profile.__enter__()
        yield
        if self._profile is not None:
            self._steps += 1
        if self.span and step == self.span[1]:
            self.close()

    def close(self) -> None:
        if self._profile is None:
            return
        profile, self._profile = self._profile, None
        profile.__exit__(None, None, None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        profile.export_chrome_trace(str(self.path))
        if self.device.type != "cuda":
            return
        import json

        overlap = comm_overlap(json.loads(self.path.read_text()), max(self._steps, 1))
        if overlap is None or not overlap["collective_kernels"]:  # (one rank: nccl launches none)
            return
        self.path.with_name(f"rank{self.rank}_comm.json").write_text(json.dumps(overlap, indent=2))
        if self.rank == 0:
            print(f"disttrain: profiled steps {self.span[0]}-{self.span[0] + self._steps - 1}: collectives "
                  f"{overlap['comm_s'] * 1e3:.2f} ms per step on the device, {overlap['comm_exposed_s'] * 1e3:.2f} ms "
                  "of it exposed (no other kernel running)", file=sys.stderr, flush=True)
