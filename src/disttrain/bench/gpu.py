"""Benchmark: validate the CUDA paths on one GPU, each check PASS or FAIL with its figures.

    disttrain bench gpu [--out docs/benchmarks/gpu.md] [--only CHECK,...] [--n-layer 24] [--d-model 2048] [--n-head 16]
                        [--seq-len 2048] [--vocab 50304] [--micro 0] [--mfu-precision bf16-mixed]
                        [--steps 10] [--no-compile] [--peak-tflops 0] [--memory-fraction 0.8]

The checks run in this order, each its own function; one that raises is reported FAIL with its one-line reason and
the others still run:

    nccl               a one-rank nccl process group over a FileStore, in this process: init, all_reduce (value and
                       time), barrier
    steps PRECISION    bf16-mixed, fp16-mixed (GradScaler), bf16-true: 40 steps of a small reference GPT through
                       `create_backend`: finite losses that fall; step time
    queued step        ddp and fsdp (one-rank nccl group), a small GPT, fp32, fused AdamW, clipping at work: the step
                       queued whole on the device against the step that reads it first (bit for bit), the host's
                       waits per step (CUDA's sync debug mode; target 1), a refused step (NaN loss, NaN gradients)
                       changing nothing, and a foreach AdamW's state loaded into the fused one (step counts on the
                       device; its next step within 1e-5 of foreach's)
    memory STRATEGY    single, ddp, fsdp (one-rank nccl group): `memory.estimate` against
                       torch.cuda.max_memory_allocated of the third step of two micro-batches (gradients are held
                       while the second one's activations are, the sum the estimate counts; under ddp beside its
                       buckets, which it rebuilt in the second step), fp32, at a medium size; target: within 10%
    comm COMPRESSION   ddp over a one-rank nccl group, compression none and bf16: comm_s from nccl's own timing of
                       each all-reduce (parallel/comm.py) over 10 steps, comm_bytes against the gradients' size in the
                       wire dtype (target: comm_s measured and positive, bytes equal)
    comm fsdp          FSDP2's all-gather (async) and reduce-scatter (sync) wrappers called directly on a one-rank nccl
                       group: both timed on the device, bytes counted, finished collectives drained before take()
    comm trace         3 ddp steps under log.profile_steps: the trace's kernels read (perf.comm_overlap); nccl's
                       time per step and the part no other kernel overlapped (exposed), where a one-rank group
                       launches any (it may launch none: then only the reading is checked)
    overhead           `bench overhead`'s loops on the default job's model over the one-rank nccl group, ddp and
                       fsdp: the step written by hand from the PyTorch tutorials against the Trainer's, with every
                       in-run figure (MFU, comm_s timed by nccl, CUDA peak memory; the ranks' summary every
                       `train.log_every` steps, 10 by default),
                       interleaved in rounds; target: ratio of median step times <= 1.02, and the same for the
                       figures' own cost: the Trainer's step with them against the same step without them (the third
                       loop, `overhead._bare_loop`). `overhead medium`: the
                       same at the medium size (24 x 1024, two micro-batches of 4 per step), where the device bounds
                       the step. A strategy over the target is profiled (`overhead.host_profile`): each loop's host and
                       device time per step, its CUDA calls by name, the operators and kernels that differ most
    tp, pp SCHEDULE,   the tensor-parallel plan (sequence and loss parallel) and the pipeline schedules 1f1b,
    pp zbv x tp        interleaved-1f1b, zbv, dualpipev, and zbv over tp, on a one-rank nccl mesh (both stages of a
                       virtual or V schedule on this rank): 5 steps of 4 micro-batches, fp32, losses within 1e-5 of
                       the plain model's (the pp/tp engines on CUDA; a GPU cannot hold two nccl ranks)
    cpu_offload        fsdp with and without parallel.cpu_offload: the peak GPU memory of a step of each, and the saving
                       against the estimated model states (target: at least 75% of them)
    mfu [fsdp]         the reference GPT at --n-layer x --d-model ... (1.3 B parameters by default), the largest
                       power-of-two micro-batch whose estimate fits --memory-fraction of the device (or --micro),
                       torch.compile, flash attention forced through SDPA: tokens/s, TFLOP/s (perf.flops_per_token),
                       MFU against perf.peak_tflops (or --peak-tflops); target >= 45%; then the same under fsdp
                       (a one-rank nccl group: FSDP2's wrapping and compile, no collective)
    service ray        (SKIP without ray) two TrainingServices on a local Ray cluster sharing this GPU by fractions
                       (training 1 x 0.5 GPU under fsdp, rollout 1 x 0.25): each rank's device, the GPU ids Ray gave,
                       the training one's losses fall

Writes the report (date, device, versions, every figure, PASS/FAIL per check) to --out, after each check (a run cut
short keeps what it measured), and prints it; exits 1 when a check failed. Notes above the line `NOTES_END` in an
existing --out file are kept. Without a CUDA device it prints one line, writes nothing and exits 0.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import gc
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from disttrain.errors import ArgumentParser, make_folder

NO_GPU = "no CUDA GPU visible: bench gpu validates the CUDA paths and needs one; nothing was run"
SMALL = {"n_layer": 4, "d_model": 256, "n_head": 4, "seq_len": 256, "vocab_size": 256}
MEDIUM = {"n_layer": 24, "d_model": 1024, "n_head": 16, "seq_len": 1024, "vocab_size": 8192}  # activations lead
OFFLOAD = {"n_layer": 12, "d_model": 2048, "n_head": 16, "seq_len": 512, "vocab_size": 8192}  # states dominate
MEMORY_TOLERANCE = 0.10
OFFLOAD_TARGET = 0.75
MFU_TARGET = 0.45
OVERHEAD_TARGET = 1.02  # the issue's: the in-run figures cost at most 2% of the default job's step
PARITY = 1e-5  # fp32 losses of a split model against one process's
GIB = 2**30
NOTES_END = "<!-- bench gpu: the report below is rewritten by each run -->"
REPORT = "docs/benchmarks/gpu.md"


class Skipped(Exception):
    """A check that cannot run here (an optional package is missing): reported SKIP, not FAIL."""


@dataclass
class Check:
    """One check's outcome. A check function fills `figures` as it goes, so a failure keeps what came before it."""

    name: str
    passed: bool = False
    figures: dict[str, str] = field(default_factory=dict)
    reason: str = ""
    """One line: the target, or why it failed or was skipped."""
    skipped: bool = False
    seconds: float = 0.0


def _args(argv):
    p = ArgumentParser(prog="disttrain bench gpu", description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help=f"where the markdown report goes (default {REPORT}; needed with "
                   "--only, whose report holds the named checks alone)")
    p.add_argument("--only", default="", help="comma-separated checks to run, by their names in the report's "
                   "table (e.g. 'overhead,comm trace'); default: all")
    p.add_argument("--n-layer", type=int, default=24, help="MFU model: blocks")
    p.add_argument("--d-model", type=int, default=2048, help="MFU model: width")
    p.add_argument("--n-head", type=int, default=16, help="MFU model: attention heads")
    p.add_argument("--seq-len", type=int, default=2048, help="MFU model: sequence length")
    p.add_argument("--vocab", type=int, default=50304, help="MFU model: vocabulary")
    p.add_argument("--micro", type=int, default=0, help="MFU micro-batch (0: the largest the estimator fits)")
    p.add_argument("--mfu-precision", default="bf16-mixed", choices=("bf16-mixed", "bf16-true"))
    p.add_argument("--steps", type=int, default=10, help="MFU: timed steps (after 3 warm-up steps)")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="MFU without torch.compile")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="the device's dense peak (0: perf.PEAK_TFLOPS)")
    p.add_argument("--memory-fraction", type=float, default=0.8,
                   help="share of the device's memory the MFU model's estimate may fill (temporaries come on top)")
    args = p.parse_args(argv)
    if args.out is None and not args.only:
        args.out = REPORT
    _check_numbers(args)
    return args


def _check_numbers(args) -> None:
    """The MFU model's sizes and the run's numbers in range, before the device is touched (one line, exit 2)."""
    from disttrain.bench import check_numbers
    from disttrain.errors import ConfigError

    check_numbers(("--n-layer", args.n_layer, 1), ("--d-model", args.d_model, 1), ("--n-head", args.n_head, 1),
                  ("--seq-len", args.seq_len, 1), ("--vocab", args.vocab, 1), ("--micro", args.micro, 0),
                  ("--steps", args.steps, 1), ("--peak-tflops", args.peak_tflops, 0.0))
    if args.d_model % args.n_head:
        raise ConfigError(f"--d-model {args.d_model} is not divisible by --n-head {args.n_head}")
    if not 0 < args.memory_fraction <= 1:
        raise ConfigError(f"--memory-fraction {args.memory_fraction:g}: give a share of the device's memory in (0, 1]")


# ----------------------------------------------------------------------------------------------
# Pure parts: configs, the micro-batch picker, the report


def mfu_size(args) -> dict[str, int]:
    return {"n_layer": args.n_layer, "d_model": args.d_model, "n_head": args.n_head, "seq_len": args.seq_len,
            "vocab_size": args.vocab}


def config(size: dict[str, int], micro: int, strategy: str, precision: str, extra: tuple[str, ...] = ()):
    """A disttrain Config of the reference GPT of `size` (what the estimator reads)."""
    from disttrain.config import load_config

    return load_config(None, [*(f"model.{k}={v}" for k, v in size.items()), f"data.micro_batch_size={micro}",
                              f"parallel.strategy={strategy}", f"parallel.precision={precision}", *extra])


def pick_micro_batch(size: dict[str, int], precision: str, budget_bytes: float, strategy: str = "single",
                     limit: int = 256) -> int | None:
    """The largest power-of-two micro-batch (at most `limit`) whose estimated per-rank total fits `budget_bytes`;
    None when not even one sequence does."""
    from disttrain.memory import estimate

    best, micro = None, 1
    while micro <= limit:
        total = estimate(config(size, micro, strategy, precision), 1, strategy).total(False)
        if total is None or total > budget_bytes:
            break
        best, micro = micro, 2 * micro
    return best


def render(checks: list[Check], env: dict[str, str], command: str) -> str:
    """The markdown report: environment, a PASS/FAIL table, then every figure of every check."""
    lines = ["# GPU validation: the CUDA paths on one device", "", f"Command: `{command}`", "", "| | |", "|---|---|"]
    lines += [f"| {key} | {value} |" for key, value in env.items()]
    lines += ["", "| check | result | seconds | target / reason |", "|---|---|---|---|"]
    lines += [f"| {c.name} | {_result(c)} | {c.seconds:.1f} | {c.reason.replace('|', '/')} |" for c in checks]
    for c in checks:
        lines += ["", f"## {c.name}: {_result(c)}", ""]
        lines += [f"- {key}: {value}" for key, value in c.figures.items()] or ["- (no figures)"]
        if c.reason:
            lines.append(f"- {'target' if c.passed else 'reason'}: {c.reason}")
    passed, skipped = sum(c.passed for c in checks), sum(c.skipped for c in checks)
    lines += ["", f"{passed} of {len(checks)} checks passed" + (f", {skipped} skipped." if skipped else ".")]
    return "\n".join(lines) + "\n"


def _result(check: Check) -> str:
    return "SKIP" if check.skipped else "PASS" if check.passed else "FAIL"


def kept_notes(path: Path) -> str:
    """What an existing report keeps: the notes written by hand above `NOTES_END` (and the marker), else ''."""
    before, marker, _ = path.read_text().partition(NOTES_END) if path.is_file() else ("", "", "")
    return before + marker + "\n\n" if marker else ""


def one_line(exc: BaseException, limit: int = 300) -> str:
    text = str(exc).strip().splitlines()
    line = f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
    return line if len(line) <= limit else line[:limit - 3] + "..."


def run_checks(checks: list[tuple[str, Callable]], args, release: Callable[[], None] = lambda: None,
               after: Callable[[list[Check]], None] = lambda done: None) -> list[Check]:
    """Run each `fn(args, check)` in turn; an exception makes that check FAIL with its one line, and the next runs.
    `after(done)` is called after each check (the report is rewritten, so a run cut short keeps what it measured)."""
    done = []
    for name, fn in checks:
        check, start = Check(name), time.perf_counter()
        print(f"disttrain: bench gpu: {name} ...", file=sys.stderr, flush=True)
        try:
            fn(args, check)
        except Skipped as exc:
            check.skipped, check.reason = True, str(exc)
        except Exception as exc:  # every failure is a finding of the report
            check.passed, check.reason = False, one_line(exc)
        try:
            release()  # after the except clause: the traceback (and the tensors its frames hold) is gone
        except Exception as exc:  # a device left broken: the next checks will say so too
            check.passed, check.reason = False, f"{check.reason}; then {one_line(exc)}".lstrip("; ")
        check.seconds = time.perf_counter() - start
        done.append(check)
        after(done)
    return done


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


# ----------------------------------------------------------------------------------------------
# Helpers on a device


def _runtime(device, group: bool):
    """This process as rank 0 of 1: with a process group (nccl on CUDA, formed once, on an in-memory store) for
    strategies that need one, else without."""
    from disttrain.config import DistConfig
    from disttrain.runtime import LaunchInfo, Runtime, init_runtime

    if group:
        return init_runtime(DistConfig(device=device.type), environ={}, always_form_group=True)
    return Runtime(LaunchInfo("single"), device, "nccl" if device.type == "cuda" else "gloo", distributed=False)


def _backend(cfg, runtime, grad_clip: float = 0.0, factory=None, **kwargs):
    import torch

    from disttrain.backend import create_backend
    from disttrain.models.gpt import GPT
    from disttrain.optim import optimizer_factory

    torch.manual_seed(0)
    with torch.device(runtime.device):  # initialised where it runs (a GPU initialises 1 B parameters in a blink)
        model = GPT(cfg.model)
    return create_backend(model, factory or optimizer_factory(cfg.optim), cfg.parallel, runtime=runtime,
                          grad_clip=grad_clip, **kwargs)


def _windows(seq_len: int):
    """The built-in synthetic language (learnable: losses fall)."""
    from disttrain.config import DataConfig
    from disttrain.data import build_datasets

    return build_datasets(DataConfig(), seq_len)[0]


def _batch(windows, index: int, micro: int):
    from disttrain.data import fetch

    return fetch(windows, [(index * micro + i) % len(windows) for i in range(micro)])


def _step(backend, windows, index: int, micro: int, accumulate: int = 1) -> dict:
    for i in range(accumulate):
        backend.forward_backward(_batch(windows, index * accumulate + i, micro), sync=i == accumulate - 1)
    return backend.optim_step()  # reads the step's totals back: the host waits for the device


def _release(device) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# ----------------------------------------------------------------------------------------------
# The checks: fn(args, check); args.device is the torch.device they run on


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
            check.figures["init_process_group + first all_reduce"] = _ms(time.perf_counter() - start)
            times = []
            for _ in range(10):
                t = time.perf_counter()
                dist.all_reduce(x)
                torch.cuda.synchronize(device)
                times.append(time.perf_counter() - t)
            check.figures["all_reduce of 64 MiB, median of 10"] = _ms(statistics.median(times))
            t = time.perf_counter()
            dist.barrier(device_ids=[device.index])
            torch.cuda.synchronize(device)
            check.figures["barrier"] = _ms(time.perf_counter() - t)
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
    cfg = config(size, micro, "single", precision, ("optim.lr=0.001",))
    backend = _backend(cfg, _runtime(args.device, group=False))
    windows = _windows(size["seq_len"])
    losses, times, out = [], [], {}
    for index in range(steps):
        start = time.perf_counter()
        out = _step(backend, windows, index, micro)
        times.append(time.perf_counter() - start)
        losses.append(out["loss"])
    finite, first, last = all(map(math.isfinite, losses)), losses[0], statistics.mean(losses[-5:])
    check.figures.update({"model": _describe(size, micro), "first loss": f"{first:.4f}",
                          "mean of the last 5 losses": f"{last:.4f}",
                          "step time, median after 5": _ms(statistics.median(times[5:] or times)),
                          "skipped steps": str(out["skipped_steps"])})
    if "loss_scale" in out:
        check.figures["final loss scale"] = f"{out['loss_scale']:g}"
    check.passed = finite and last < first - 0.5 and out["skipped_steps"] < steps // 2
    check.reason = ("finite losses, the last 5 at least 0.5 below the first, under half the steps skipped"
                    if check.passed else
                    "non-finite loss" if not finite else f"losses did not fall ({first:.4f} -> {last:.4f}) "
                    f"or too many skipped steps ({out['skipped_steps']} of {steps})")


def _state(backend) -> list:
    """The parameters and the optimizer's state, copied (a rank's local shards under FSDP2)."""
    import torch

    from disttrain.parallel.state import local_tensor

    def local(t):
        return local_tensor(t).detach().clone()

    state = [local(t) for s in backend.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return [local(p) for p in backend.model.parameters()] + state


def _equal(a: list, b: list) -> bool:
    import torch

    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _max_difference(a: list, b: list) -> float:
    return max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b, strict=True) if x.numel())


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
    windows = _windows(size["seq_len"])
    batches = [to_device(_batch(windows, i, micro), device) for i in range(12)]

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
        cfg = config(size, micro, strategy, "fp32", ("optim.lr=0.001",))
        runtime = _runtime(device, group=registry.get(strategy).needs_group)
        queued, read = (_backend(cfg, runtime, grad_clip=clip) for _ in range(2))
        on_device = queued.prepared.steps_on_device(device)
        read.prepared.steps_on_device = lambda device: False
        outs = {name: [(o["loss"], o["grad_norm"], o["skipped"]) for o in (step(b, i) for i in range(3))]
                for name, b in (("queued", queued), ("read", read))}
        same = outs["queued"] == outs["read"] and _equal(_state(queued), _state(read))
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
            backend = _backend(cfg, runtime, grad_clip=clip, on_nonfinite="skip")
            step(backend, 0)
            before = _state(backend)
            # NaN loss; or a loss of 0 whose gradient is NaN (sqrt's slope at 0 is inf, times the mean's 0)
            loss_fn = ((lambda out, batch: out.float().mean() * float("nan")) if bad == "loss" else
                       (lambda out, batch: (out.float().mean() * 0.0).sqrt()))
            backend.forward_backward(batches[1], loss_fn=loss_fn)
            out = backend.optim_step()
            refusals.append(out["skipped"] and _equal(before, _state(backend)))
        check.figures[f"{strategy}: a refused step (NaN loss / NaN gradients) leaves the state as it was"] = (
            " / ".join(map(str, refusals)))
        saved = _backend(cfg, runtime, factory=foreach)
        for i in range(2):
            step(saved, i)
        loaded = _backend(cfg, runtime, factory=fused)
        loaded.load_state_dict(copy.deepcopy(saved.state_dict()))  # (both go on: neither may hold the other's)
        from disttrain.parallel.state import local_tensor

        steps_placed = all(
            s["step"].device == local_tensor(p).device
            and s["step"].dtype == torch.float32 for p, s in loaded.optimizer.state.items())
        step(saved, 2)
        step(loaded, 2)
        difference = _max_difference(_state(saved), _state(loaded))
        resumed_queued = loaded.prepared.steps_on_device(device)
        check.figures[f"{strategy}: foreach state loaded into fused AdamW: step counts on the device / queued / "
                      "next step's largest difference from foreach's"] = (
            f"{steps_placed} / {resumed_queued} / {difference:.2e}")
        results.append(on_device and same and clipped and syncs_ok and all(refusals) and steps_placed
                       and resumed_queued and difference < 1e-5)
        del queued, read, backend, saved, loaded
        _release(device)
    check.figures["model"] = _describe(size, micro) + f", fp32, fused AdamW, grad_clip {clip}"
    check.passed = all(results)
    check.reason = ("queued and read-first steps equal bit for bit, one host wait per step (CUDA), refused steps "
                    "change nothing, a foreach state resumes in the fused step within 1e-5" if check.passed else
                    "failed for " + ", ".join(s for s, ok in zip(strategies, results, strict=True) if not ok)
                    + " (the figures say which part)")


def check_memory(args, check: Check, strategy: str, size: dict[str, int] = MEDIUM, micro: int = 4) -> None:
    """The estimate's total against the allocator's peak over the third step, the steady state the estimate counts
    (the first creates optimizer state; in the second DDP rebuilds its buckets and frees the old ones)."""
    import torch

    from disttrain.memory import estimate
    from disttrain.parallel import registry

    cfg = config(size, micro, strategy, "fp32", (f"data.global_batch_size={2 * micro}",))  # the 2 micro-batches run
    est = estimate(cfg, 1, strategy)
    backend = _backend(cfg, _runtime(args.device, group=registry.get(strategy).needs_group))
    windows = _windows(size["seq_len"])
    meter = getattr(backend.prepared, "comm", None)
    for index in range(2):  # the first creates optimizer state; DDP rebuilds its buckets in the second's forward
        _step(backend, windows, index, micro, accumulate=2)
        if meter is not None:  # as the Trainer does after each step (perf.StepMeter): the meter holds the
            meter.take()  # collectives' Works, and with them the buckets they reduced
    torch.cuda.synchronize(args.device)
    torch.cuda.reset_peak_memory_stats(args.device)
    held = torch.cuda.memory_allocated(args.device)
    _step(backend, windows, 2, micro, accumulate=2)
    peak = torch.cuda.max_memory_allocated(args.device)
    total = est.total(False)
    ratio = peak / total
    check.figures.update({
        "model": _describe(size, micro) + ", fp32, AdamW, 2 micro-batches per step",
        "estimate: params / grads / optimizer / activations":
            " / ".join(_gib(n) for n in (est.params, est.grads, est.optimizer, est.activations)),
        "estimate total": _gib(total), "measured peak (max_memory_allocated)": _gib(peak),
        "measured / estimate": f"{ratio:.3f}",
        "held between steps (params + optimizer state; under ddp its buckets too) vs the estimate's params + "
        "optimizer state":
            f"{_gib(held)} vs {_gib(est.params + est.optimizer)}"})
    check.passed = abs(ratio - 1) <= MEMORY_TOLERANCE
    check.reason = f"measured / estimate within 1 +- {MEMORY_TOLERANCE:g}" + ("" if check.passed else
                                                                              f": {ratio:.3f}")


def check_comm(args, check: Check, compression: str, size: dict[str, int] = MEDIUM, micro: int = 4,
               steps: int = 10) -> None:
    """In-run communication figures on CUDA: the meter DDP's hook feeds, read as the Trainer reads it."""
    cfg = config(size, micro, "ddp", "bf16-mixed", (f"parallel.grad_compression={compression}",))
    backend = _backend(cfg, _runtime(args.device, group=True))
    meter = backend.prepared.comm
    if meter is None or not meter.on_device:
        raise RuntimeError("ddp on CUDA made no device-timed communication meter")
    windows = _windows(size["seq_len"])
    _step(backend, windows, 0, micro)
    _step(backend, windows, 1, micro)  # DDP rebuilds its buckets after the first step
    meter.take()
    seconds, times, nbytes = [], [], 0
    for index in range(steps):
        start = time.perf_counter()
        _step(backend, windows, 2 + index, micro)
        times.append(time.perf_counter() - start)
        comm_s, nbytes = meter.take()
        seconds.append(comm_s)
    from disttrain.parallel.comm import WIRE_DTYPES

    wire = WIRE_DTYPES[compression].itemsize if compression in WIRE_DTYPES else 4  # fp32 gradients otherwise
    expected = wire * sum(p.numel() for p in backend.model.parameters() if p.requires_grad)
    measured = [s for s in seconds if s is not None]
    check.figures.update({"model": _describe(size, micro) + f", bf16-mixed, ddp, grad_compression={compression}",
                          "comm_s per step, median of 10": _ms(statistics.median(measured)) if measured else "None",
                          "step time, median of 10": _ms(statistics.median(times)),
                          "comm_bytes per step": f"{nbytes:,} (gradients in the wire dtype: {expected:,})",
                          "TORCH_NCCL_ENABLE_TIMING": os.environ.get("TORCH_NCCL_ENABLE_TIMING", "unset")})
    check.passed = len(measured) == steps and all(s > 0 for s in measured) and nbytes == expected
    check.reason = "comm_s measured and positive every step, comm_bytes = the gradients' bytes on the wire" + (
        "" if check.passed else f": comm_s {seconds}, bytes {nbytes} vs {expected}")


def check_comm_trace(args, check: Check, size: dict[str, int] = MEDIUM, micro: int = 4, steps: int = 3) -> None:
    """Exposed communication on CUDA, which the per-step figures leave null: `steps` ddp steps under
    `log.profile_steps` (perf.StepProfiler), the trace's nccl kernels against its other kernels (perf.comm_overlap)."""
    import json

    from disttrain.perf import StepProfiler, comm_overlap

    cfg = config(size, micro, "ddp", "bf16-mixed")
    backend = _backend(cfg, _runtime(args.device, group=True))
    windows = _windows(size["seq_len"])
    _step(backend, windows, 0, micro)
    _step(backend, windows, 1, micro)  # DDP rebuilds its buckets after the first step
    with tempfile.TemporaryDirectory() as run_dir:
        with StepProfiler((3, 2 + steps), Path(run_dir), 0, args.device) as profiler:
            for step in range(3, 3 + steps):
                with profiler.step(step):
                    _step(backend, windows, step, micro)
        trace = json.loads((Path(run_dir) / "profile" / "rank0.json").read_text())
    overlap = comm_overlap(trace, steps)  # what StepProfiler writes to rank<R>_comm.json where nccl launches kernels
    check.figures["model"] = _describe(size, micro) + ", bf16-mixed, ddp, one-rank nccl group"
    if overlap is None:
        check.passed, check.reason = False, "the trace has no kernels"
        return
    check.figures.update({"kernels in the trace (nccl's)": f"{overlap['kernels']} ({overlap['collective_kernels']})",
                          "collectives per step (nccl kernels)": _ms(overlap["comm_s"]),
                          "exposed (no other kernel running)": _ms(overlap["comm_exposed_s"]),
                          "hidden": _ms(overlap["comm_hidden_s"])})
    check.passed = 0 <= overlap["comm_exposed_s"] <= overlap["comm_s"]
    check.reason = ("the trace's kernels read; nccl's " + ("timed, exposed within their time"
                                                            if overlap["collective_kernels"] else
                                                            "none at one rank (nccl launches no kernel for it)")
                    if check.passed else f"comm_s {overlap['comm_s']}, exposed {overlap['comm_exposed_s']}")


def check_overhead(args, check: Check, strategies: tuple[str, ...] = ("ddp", "fsdp"), rounds: int = 16,
                   steps: int = 40, size: dict[str, int] | None = None, micro: int = 16, global_batch: int = 32,
                   profile: bool = False, profile_steps: int = 10) -> None:
    """The in-run figures' cost on CUDA, with `bench overhead`'s own loops and rounds (overhead._compare) in this
    process: the hand-written step against the Trainer's step with its figures, as logged (`train.log_every`), on the
    default job's model (launch-bound on a GPU, so any host cost of the figures shows in full) or on `size`. A
    strategy over the target (or every one with `profile`) gets a profile of where the two loops' host time goes
    (`overhead.host_profile`), so that one run on a lent GPU also says why."""
    from disttrain.bench import overhead
    from disttrain.data import GlobalSampler, build_datasets

    runtime = _runtime(args.device, group=True)
    model = tuple(f"model.{k}={v}" for k, v in (size or {}).items())
    ratios, costs, jobs = {}, {}, {}
    with tempfile.TemporaryDirectory() as out:
        bench = argparse.Namespace(global_batch=global_batch, micro=micro, nproc=1, out=out, rounds=rounds,
                                   steps=steps)
        for strategy in strategies:
            cfg = overhead._config(bench, strategy, model)
            train, _ = build_datasets(cfg.data, cfg.model.seq_len)
            jobs[strategy] = cfg, train
            times = overhead._compare(bench, cfg, runtime, train, GlobalSampler(len(train), cfg.run.seed))
            plain, ours, bare = (statistics.median(times[loop]) for loop in ("plain", "disttrain", "bare"))
            ratios[strategy], costs[strategy] = ours / plain, ours / bare
            check.figures[f"{strategy}: hand-written / disttrain, median step"] = (
                f"{_ms(plain)} / {_ms(ours)}, ratio {ratios[strategy]:.3f}")
            check.figures[f"{strategy}: the figures' cost, disttrain without / with them"] = (
                f"{_ms(bare)} / {_ms(ours)}, ratio {costs[strategy]:.3f} (the issue's figure: <= 1.02)")
        for strategy, (cfg, train) in jobs.items():  # after every comparison: none times steps after a profile
            if profile or ratios[strategy] > OVERHEAD_TARGET:
                check.figures.update({f"{strategy}: {k}": v for k, v in overhead.host_profile(
                    cfg, runtime, train, GlobalSampler(len(train), cfg.run.seed), profile_steps).items()})
    m = cfg.model
    check.figures["model"] = (f"GPT {m.n_layer} x {m.d_model}, seq {m.seq_len}, micro-batch {micro}, global batch "
                              f"{global_batch}, {cfg.parallel.precision}, one-rank nccl group; {rounds} interleaved "
                              f"rounds of {steps} steps per loop")
    over = [f"{s} {r:.3f} against the hand-written loop" for s, r in ratios.items() if r > OVERHEAD_TARGET]
    over += [f"{s} {r:.3f} with its figures against without" for s, r in costs.items() if r > OVERHEAD_TARGET]
    check.passed = not over
    check.reason = (f"ratios of median step times, disttrain / hand-written and with / without its figures, <= "
                    f"{OVERHEAD_TARGET}" if check.passed else f"over {OVERHEAD_TARGET}: " + ", ".join(over))


def check_fsdp_comm(args, check: Check, calls: int = 50) -> None:
    """FSDP2's collectives as FSDP2 calls them, timed on the device (FSDP2 issues none at world size 1, so the
    strategy's own steps cannot show this): an asynchronous all-gather (nccl's timing of its Work) and a
    synchronous reduce-scatter (CUDA events around it on the caller's stream), `calls` of each with no `take()`
    between them (finished collectives are drained, not held), then one `take()`."""
    import torch
    import torch.distributed as dist

    from disttrain.parallel.comm import CommMeter, fsdp_comms

    _runtime(args.device, group=True)
    meter = CommMeter(on_device=True)
    all_gather, reduce_scatter, all_reduced = fsdp_comms(meter)
    x = torch.randn(2**24, device=args.device)  # 64 MiB of float32
    gathered, reduced = torch.empty_like(x), torch.empty_like(x)
    expected, held = 3 * calls * x.numel() * x.element_size(), 0
    for _ in range(calls):
        all_gather(gathered, x, dist.group.WORLD, async_op=True).wait()
        reduce_scatter(reduced, x, dist.group.WORLD, dist.ReduceOp.SUM, async_op=False)
        all_reduced(reduced)  # HSDP's hook after its all-reduce: the span from the reduce-scatter's end
        held = max(held, meter.in_flight())
    seconds, nbytes = meter.take()
    check.figures.update({"collectives": f"{calls} all-gathers (async) + {calls} reduce-scatters (sync) of 64 MiB, "
                                         "each followed by HSDP's all-reduce hook, one rank",
                          "comm_s": _ms(seconds) if seconds is not None else "None",
                          "comm_bytes": f"{nbytes:,} (expected {expected:,})",
                          "most collectives held at once before take()": str(held),
                          "reduce-scatter result": "equal to its input" if torch.equal(reduced, x) else "WRONG"})
    check.passed = (seconds is not None and seconds > 0 and nbytes == expected and held <= 6
                    and torch.equal(reduced, x))
    check.reason = ("all three kinds timed, bytes counted, finished collectives drained (at most 6 held), results right"
                    if check.passed else f"comm_s {seconds}, bytes {nbytes}, held {held}")


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

    cfg = config(size, micro, "fsdp", "bf16-mixed")
    runtime = _runtime(args.device, group=True)
    backend = _backend(cfg, runtime)
    windows = _windows(size["seq_len"])
    for index in range(steps):
        _step(backend, windows, index, micro)
    state_bytes = sum(t.numel() * t.element_size() for t in _state(backend))
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
        fresh = _backend(cfg, runtime)
        fresh.load_state_dict(manager.load("latest", target=fresh.prepared.checkpoint_target))
    same = _equal(_state(backend), _state(fresh))
    saved_next, loaded_next = (_step(b, windows, steps, micro)["loss"] for b in (backend, fresh))
    check.figures.update({"model": _describe(size, micro) + ", bf16-mixed, fsdp, async save (copy deferred)",
                          "state (parameters and optimizer, this rank)": _gib(state_bytes),
                          "device memory grown while the copy was staged": _gib(grown) if cuda else "n/a (CPU)",
                          "loaded state": "equal bit for bit" if same else "DIFFERENT",
                          "next step's loss, saved / loaded": f"{saved_next!r} / {loaded_next!r}"})
    check.passed = grown < 0.1 * state_bytes and same and saved_next == loaded_next
    check.reason = ("staged on the host, resumed bit for bit" if check.passed else
                    f"grew {_gib(grown)} of {_gib(state_bytes)}, state equal {same}, losses {saved_next} / "
                    f"{loaded_next}")


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

    cfg = config(size, micro, "single", "fp32", ("optim.lr=0.001",))
    windows = _windows(size["seq_len"])
    losses, times = {}, {}
    for name in ("single", "split"):
        backend = (_backend(cfg, _runtime(args.device, group=False)) if name == "single" else
                   _split_backend(cfg, _runtime(args.device, group=True), tensor_parallel, schedule))
        losses[name], times[name] = [], []
        for index in range(steps):
            start = time.perf_counter()
            losses[name].append(_step(backend, windows, index, micro, accumulate)["loss"])
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
        _release(args.device)
    worst = max(abs(a - b) for a, b in zip(losses["single"], losses["split"], strict=True))
    check.figures.update({
        "model": _describe(size, micro) + f", fp32, {accumulate} micro-batches per step",
        "losses, one process": " ".join(f"{x:.6f}" for x in losses["single"]),
        "losses, split": " ".join(f"{x:.6f}" for x in losses["split"]),
        "max abs loss difference": f"{worst:.2e}",
        "step time after the first, one process / split": " / ".join(
            _ms(statistics.median(times[n][1:])) for n in ("single", "split"))})
    check.passed = worst <= PARITY and all(map(math.isfinite, losses["split"]))
    check.reason = f"losses equal to one process's within {PARITY:g} over {steps} steps" + (
        "" if check.passed else f": {worst:.2e}")


def check_cpu_offload(args, check: Check, size: dict[str, int] = OFFLOAD, micro: int = 2) -> None:
    import torch

    from disttrain.memory import estimate

    peaks = {}
    windows = _windows(size["seq_len"])
    for offload in (False, True):
        cfg = config(size, micro, "fsdp", "fp32", (f"parallel.cpu_offload={str(offload).lower()}",))
        backend = _backend(cfg, _runtime(args.device, group=True))
        _step(backend, windows, 0, micro)
        torch.cuda.synchronize(args.device)
        torch.cuda.reset_peak_memory_stats(args.device)
        _step(backend, windows, 1, micro)
        peaks[offload] = torch.cuda.max_memory_allocated(args.device)
        check.figures[f"peak GPU memory of a step, cpu_offload={str(offload).lower()}"] = _gib(peaks[offload])
        del backend
        _release(args.device)
    est = estimate(config(size, micro, "fsdp", "fp32"), 1, "fsdp")
    states = est.params + est.grads + est.optimizer
    saved = peaks[False] - peaks[True]
    check.figures.update({"model": _describe(size, micro) + ", fp32, AdamW",
                          "saved": f"{_gib(saved)} of {_gib(states)} estimated model states ({saved / states:.0%})"})
    check.passed = saved >= OFFLOAD_TARGET * states
    check.reason = f"saves at least {OFFLOAD_TARGET:.0%} of the model states" + (
        "" if check.passed else f": {saved / states:.0%}")


def check_mfu(args, check: Check, strategy: str = "single") -> None:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from disttrain.memory import estimate
    from disttrain.perf import flops_per_token, peak_tflops

    device, size, precision = args.device, mfu_size(args), args.mfu_precision
    budget = args.memory_fraction * torch.cuda.get_device_properties(device).total_memory
    micro = args.micro or pick_micro_batch(size, precision, budget, strategy)
    if micro is None:
        raise RuntimeError(f"the model does not fit {_gib(budget)} (--memory-fraction {args.memory_fraction}) even "
                           "at micro-batch 1; pass a smaller --n-layer / --d-model / --seq-len")
    from disttrain.parallel import registry

    cfg = config(size, micro, strategy, precision)
    needs_group = registry.get(strategy).needs_group
    backend = _backend(cfg, _runtime(device, group=needs_group), grad_clip=1.0)  # the Trainer's clip
    flops = flops_per_token(backend.model, args.seq_len)
    peak = args.peak_tflops or peak_tflops(device, precision)
    check.figures.update({"model": _describe(size, micro) + f", {strategy}, {precision}, AdamW, grad clip 1.0",
                          "parameters": f"{sum(p.numel() for p in backend.model.parameters()) / 1e9:.3f} B",
                          "training FLOPs per token": f"{flops / 1e9:.2f} GFLOP",
                          "torch.compile": str(args.compile), "attention": "SDPA, flash attention forced",
                          "estimate total": _gib(estimate(cfg, 1, strategy).total(False))})
    if args.compile:
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
    check.figures.update({"step time": _ms(elapsed / args.steps), "tokens/s": f"{tokens_per_s:,.0f}",
                          "achieved TFLOP/s": f"{tflops:.1f}",
                          "peak TFLOP/s": f"{peak:g}" if peak else "unknown for this device (pass --peak-tflops)",
                          "peak memory (max_memory_allocated)": _gib(torch.cuda.max_memory_allocated(device)),
                          "last loss": f"{out['loss']:.4f}"})
    if not peak:
        raise RuntimeError(f"no peak TFLOP/s known for {torch.cuda.get_device_name(device)}; pass --peak-tflops")
    mfu = tflops / peak
    check.figures["MFU"] = f"{mfu:.1%}"
    check.passed = mfu >= MFU_TARGET and math.isfinite(out["loss"])
    check.reason = f"MFU >= {MFU_TARGET:.0%}" + ("" if check.passed else f": {mfu:.1%}")


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
            windows, losses = _windows(size["seq_len"]), []
            start = time.perf_counter()
            for index in range(steps):
                await training.forward_backward(_batch(windows, index, micro))
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
    check.figures.update({"training service": f"1 x 0.5 GPU, fsdp, bf16-mixed, {_describe(size, micro)}",
                          "rollout service": "1 x 0.25 GPU", "devices (training, rollout)": str(devices),
                          "GPU ids Ray gave (training, rollout)": str(gpus),
                          "losses": f"{first:.4f} -> {last:.4f} (mean of the last 5) over {steps} steps",
                          "seconds per step (driver round trips included)": f"{elapsed / steps:.3f}"})
    on_gpu = all(d.startswith("cuda") for group in devices for d in group)
    shared = len({ids[0] for group in gpus for ids in group if len(ids) == 1}) == 1  # one GPU id, both services
    check.passed = on_gpu and shared and all(len(ids) == 1 for group in gpus for ids in group) and last < first - 0.5
    check.reason = ("both services on the GPU Ray assigned (fractions of one device), the training one learns"
                    if check.passed else f"devices {devices}, GPU ids {gpus}, losses {first:.4f} -> {last:.4f}")


def _describe(size: dict[str, int], micro: int) -> str:
    return (f"GPT {size['n_layer']} x {size['d_model']} ({size['n_head']} heads), seq {size['seq_len']}, "
            f"vocab {size['vocab_size']}, micro-batch {micro}")


CHECKS: list[tuple[str, Callable]] = [
    ("nccl", check_nccl),
    *((f"steps {p}", partial(check_steps, precision=p)) for p in ("bf16-mixed", "fp16-mixed", "bf16-true")),
    ("queued step", check_queued_step),
    *((f"memory {s}", partial(check_memory, strategy=s)) for s in ("single", "ddp", "fsdp")),
    *((f"comm {c}", partial(check_comm, compression=c)) for c in ("none", "bf16")),
    ("comm fsdp", check_fsdp_comm),
    ("comm trace", check_comm_trace),
    ("checkpoint", check_checkpoint),
    ("overhead", check_overhead),
    ("overhead medium", partial(check_overhead, rounds=4, steps=10, size=MEDIUM, micro=4, global_batch=8)),
    ("tp", partial(check_split, tensor_parallel=True)),
    *((f"pp {s}", partial(check_split, tensor_parallel=False, schedule=s)) for s in ("1f1b", "interleaved-1f1b",
                                                                                     "zbv", "dualpipev")),
    ("pp zbv x tp", partial(check_split, tensor_parallel=True, schedule="zbv")),
    ("cpu_offload", check_cpu_offload),
    ("mfu", check_mfu),
    ("mfu fsdp", partial(check_mfu, strategy="fsdp")),
    ("service ray", check_service),
]


def environment(device) -> dict[str, str]:
    import torch

    props = torch.cuda.get_device_properties(device)
    nccl = torch.cuda.nccl.version() if torch.distributed.is_nccl_available() else None
    return {"date": datetime.date.today().isoformat(),
            "device": f"{props.name} ({props.total_memory / GIB:.1f} GiB, compute capability "
                      f"{props.major}.{props.minor})",
            "torch": torch.__version__, "CUDA": str(torch.version.cuda),
            "NCCL": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)}


def selected(only: str, out: str | None = REPORT) -> list[tuple[str, Callable]]:
    """The checks `--only` names (all when empty), in their usual order; ConfigError (one line) for a name that is
    not a check, or for `--only` without `--out` (the default report holds every check's figures and notes)."""
    from disttrain.errors import ConfigError

    names = [n.strip() for n in only.split(",") if n.strip()]
    known = [name for name, _ in CHECKS]
    if only.strip() and not names:
        raise ConfigError(f"--only {only!r} names no check; the checks are: {', '.join(known)}")
    for name in names:
        if name not in known:
            raise ConfigError(f"--only {name!r}: not a check of bench gpu; the checks are: {', '.join(known)}")
    if names and out is None:
        raise ConfigError(f"--only {only!r} reports the named checks alone: give --out FILE ({REPORT}, the default, "
                          "holds every check's report)")
    return [c for c in CHECKS if not names or c[0] in names]


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    checks_to_run = selected(args.only, args.out)
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        print(NO_GPU)
        return 0
    args.device = torch.device("cuda", 0)
    torch.cuda.set_device(args.device)
    env = environment(args.device)  # before any check can leave the device broken
    command = " ".join(["disttrain bench gpu", *(argv if argv is not None else sys.argv[1:])])
    out = Path(args.out)
    make_folder(out.parent, "--out")
    kept = kept_notes(out)

    def write(done: list[Check]) -> None:
        out.write_text(kept + render(done, env, command))

    checks = run_checks(checks_to_run, args, release=lambda: _release(args.device), after=write)
    import torch.distributed as dist

    if dist.is_initialized():  # formed by the fsdp checks
        dist.destroy_process_group()
    print(out.read_text())
    return 0 if all(c.passed or c.skipped for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
