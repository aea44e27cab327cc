"""Benchmark: validate the CUDA paths on one GPU, each check PASS or FAIL with its figures.

    disttrain bench gpu [--out docs/benchmarks/gpu.md] [--only CHECK,...] [--n-layer 24] [--d-model 2048] [--n-head 16]
                        [--seq-len 2048] [--vocab 50304] [--micro 0] [--mfu-precision bf16-mixed]
                        [--steps 10] [--no-compile] [--peak-tflops 0] [--memory-fraction 0.8]

The checks run in this order, each its own function (`steps.py`, `memory.py`, `comm.py`, `split.py`, on what
`kit.py` gives them: a one-rank runtime, a backend, batches, a step); one that raises is reported FAIL with its
one-line reason and the others still run:

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
                       buckets, which it rebuilt in the second step), fp32, at a medium size; target: within 10%;
                       `memory compiled`: single with each block compiled (parallel.compile = "inductor"), against
                       the same estimate (which counts what eager blocks save)
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
                       loop, `loops.bare_loop`). `overhead medium`: the
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
                       (a one-rank nccl group: FSDP2's wrapping and compile, no collective); `mfu blocks`: under
                       fsdp with each block compiled as `parallel.compile = "inductor"` does (a user's job)
    service ray        (SKIP without ray) two TrainingServices on a local Ray cluster sharing this GPU by fractions
                       (training 1 x 0.5 GPU under fsdp, rollout 1 x 0.25): each rank's device, the GPU ids Ray gave,
                       the training one's losses fall

Writes the report (date, device, versions, every figure, PASS/FAIL per check) to --out, after each check (a run cut
short keeps what it measured), and prints it; exits 1 when a check failed. Notes above the line `NOTES_END` in an
existing --out file are kept. Without a CUDA device it prints one line, writes nothing and exits 0.
"""

from __future__ import annotations

import datetime
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from disttrain.bench.gpu import kit
from disttrain.bench.gpu.comm import check_comm, check_comm_trace, check_fsdp_comm, check_overhead
from disttrain.bench.gpu.kit import GIB, MEDIUM, Check, Skipped
from disttrain.bench.gpu.memory import check_cpu_offload, check_memory, check_mfu
from disttrain.bench.gpu.split import check_service, check_split
from disttrain.bench.gpu.steps import check_checkpoint, check_nccl, check_queued_step, check_steps
from disttrain.errors import ArgumentParser, make_folder

NO_GPU = "no CUDA GPU visible: bench gpu validates the CUDA paths and needs one; nothing was run"
NOTES_END = "<!-- bench gpu: the report below is rewritten by each run -->"
REPORT = "docs/benchmarks/gpu.md"


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
    p.add_argument("--no-compile", dest="compile", action="store_false",
                   help="MFU without torch.compile; skips the checks of compiled blocks")
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


CHECKS: list[tuple[str, Callable]] = [
    ("nccl", check_nccl),
    *((f"steps {p}", partial(check_steps, precision=p)) for p in ("bf16-mixed", "fp16-mixed", "bf16-true")),
    ("queued step", check_queued_step),
    *((f"memory {s}", partial(check_memory, strategy=s)) for s in ("single", "ddp", "fsdp")),
    ("memory compiled", partial(check_memory, strategy="single", compiled=True)),
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
    ("mfu blocks", partial(check_mfu, strategy="fsdp", blocks=True)),
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

    checks = run_checks(checks_to_run, args, release=lambda: kit.release(args.device), after=write)
    import torch.distributed as dist

    if dist.is_initialized():  # formed by the fsdp checks
        dist.destroy_process_group()
    print(out.read_text())
    return 0 if all(c.passed or c.skipped for c in checks) else 1

