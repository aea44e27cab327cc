"""Benchmark: latency and bandwidth of the collectives data-parallel training runs on, over message sizes.

    disttrain bench comm [--collectives all_reduce,all_gather,reduce_scatter,broadcast,all_to_all]
                         [--min-size 1K] [--max-size 256M] [--factor 4] [--nproc N] [--busy 0|1|step]
                         [--compute-ms 8] [--dtype float32,bfloat16,float16] [--out bench_results]

`--nproc` ranks (default 2 on CPU with gloo, every visible GPU with nccl) run each collective on buffers of each
size, `--factor` apart, in each `--dtype` (float32 by default; bfloat16 / float16 are what gradient compression and
a mixed precision's gathers send, and gloo reduces them slower per byte than float32). Sizes follow nccl-tests: S is
the whole buffer (all_gather's output, reduce_scatter's input, all_to_all's buffer per rank), rounded down to a
multiple of the element's bytes x ranks. Every timed call starts after a
barrier; its time (on CUDA the device's, by events: `_measure`) is the slowest rank's; the figure is the median over
the iterations after warm-up (fewer for big sizes: `--iters` up to 4 MiB, then in proportion to the size, at least
`--min-iters`). The sizes of a collective take turns, one call each per round, so that a slow spell of a shared
machine does not bend the curve at one size.
algbw = S / time; busbw = algbw x 2(n-1)/n for all_reduce, x (n-1)/n for all_gather, reduce_scatter and
all_to_all, x 1 for broadcast.

`--busy 1` keeps a thread per rank computing (matrix multiplies) while the collectives are timed: on a CPU machine
whose cores all run ranks, gloo's threads share them with the ranks' compute (measured here: 1.2-2x the idle
figures at 1-16 MiB). `--busy step` times them as a training step on a CPU machine issues them: every rank computes
for `--compute-ms` on its own thread before each call (untimed; the ranks then reach the call as unevenly as a step's
ranks do, and the cores idle during it, as they do when a rank waits for its collective: there are no streams to
overlap on), and the all-gather's output and the reduce-scatter's input and output are new tensors at every call,
as FSDP2 allocates them (all_reduce works in place, as on DDP's persistent buckets). `disttrain bench predict
--measure --validate` fits the links it predicts CPU steps with this way.

Per collective and dtype, alpha (s) and beta (s/byte) of t = alpha + beta * S are fitted by least squares on the
relative error (interconnect.fit_alpha_beta), so small and large sizes both count. On a CPU each call's CPU seconds
on the process group's own threads (gloo's; `bench.backend_threads_seconds`, read before and after the call, outside
its timing) are recorded and fitted the same way (`cpu_alpha_s`, `cpu_beta_s_per_byte`): what a call issued while its
rank computes takes from the cores, which the scale model charges DDP's buckets on a host whose cores all run ranks.
Results (comm_report.py): `<out>/comm.csv`, `comm.md` (table, fit, config, versions, machine, date), `comm.png`
(latency and busbw vs size, log-log; needs matplotlib) and `comm_fit.json` (the fit, which `disttrain bench predict
--interconnect measured:PATH` reads).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import threading
import time
import warnings
from pathlib import Path

from disttrain.bench import check_numbers, rank_limit
from disttrain.bench.comm_report import report
from disttrain.bench.interconnect import COLLECTIVES, DTYPES
from disttrain.errors import ArgumentParser, ConfigError

_UNITS = {"": 1, "K": 2**10, "KIB": 2**10, "M": 2**20, "MIB": 2**20, "G": 2**30, "GIB": 2**30}


def parse_size(text: str, flag: str) -> int:
    """Bytes of `"1K"`, `"256M"`, `"1G"` (powers of 1024, as nccl-tests' -b/-e) or a plain number of bytes."""
    match = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", str(text))
    unit = match and match.group(2).upper()
    if not match or unit not in _UNITS or int(match.group(1)) == 0:
        raise ConfigError(f"{flag} {text!r} is not a size; give bytes or a number with K, M or G (powers of 1024), "
                          f"e.g. {flag} 1K")
    return int(match.group(1)) * _UNITS[unit]


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(prog="disttrain bench comm", description=__doc__.split("\n")[0])
    p.add_argument("--collectives", default=",".join(COLLECTIVES), help="comma-separated: " + ", ".join(COLLECTIVES))
    p.add_argument("--min-size", default="1K", help="smallest message, e.g. 1K")
    p.add_argument("--max-size", default="256M", help="largest message, e.g. 256M")
    p.add_argument("--factor", type=int, default=4, choices=[2, 4], help="ratio between consecutive sizes")
    p.add_argument("--nproc", type=int, default=0, help="ranks (default: every visible GPU, else 2)")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per size up to 4 MiB")
    p.add_argument("--min-iters", type=int, default=3, help="timed iterations of the largest sizes")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations per size")
    p.add_argument("--busy", default="0", choices=["0", "1", "step"],
                   help="1: a thread per rank keeps computing (matmuls) while the collectives are timed; step: each "
                        "rank computes for --compute-ms before each call, which writes into new tensors, as a "
                        "training step on a CPU machine issues its collectives")
    p.add_argument("--compute-ms", type=float, default=None,
                   help="with --busy step: milliseconds of compute before each timed call (default 8)")
    p.add_argument("--dtype", default="float32",
                   help="comma-separated element types: " + ", ".join(DTYPES) + " (the first one's fit is the main "
                        "one; the scale model prices each collective's bytes with the fit of its dtype)")
    p.add_argument("--out", default="bench_results")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def sizes(low: int, high: int, factor: int) -> list[int]:
    out = [low]
    while out[-1] * factor <= high:
        out.append(out[-1] * factor)
    return out


def iterations(size: int, iters: int, min_iters: int) -> int:
    return max(min_iters, min(iters, round(iters * 2**22 / size)))


def check(args: argparse.Namespace) -> None:
    """Refuse bad input in one line before any process starts; fill in the default world size."""
    import torch

    names = list(dict.fromkeys(c for c in args.collectives.split(",") if c))
    args.collectives = ",".join(names)
    unknown = [c for c in names if c not in COLLECTIVES]
    if unknown or not names:
        what = f"{', '.join(unknown)} unknown" if unknown else "none given"
        raise ConfigError(f"--collectives: {what}; choose from {', '.join(COLLECTIVES)}")
    dtypes = list(dict.fromkeys(d.strip() for d in args.dtype.split(",") if d.strip()))
    if not dtypes or set(dtypes) - set(DTYPES):
        wrong = ", ".join(d for d in dtypes if d not in DTYPES) or "none given"
        raise ConfigError(f"--dtype {args.dtype!r}: {wrong}; choose from {', '.join(DTYPES)}")
    args.dtype = ",".join(dtypes)
    low, high = parse_size(args.min_size, "--min-size"), parse_size(args.max_size, "--max-size")
    if low > high:
        raise ConfigError(f"--min-size {args.min_size} is above --max-size {args.max_size}")
    if args.compute_ms is not None and args.busy != "step":
        raise ConfigError(f"--compute-ms {args.compute_ms:g} applies to --busy step only; add --busy step or leave it "
                          "out")
    args.compute_ms = 8.0 if args.compute_ms is None else args.compute_ms
    if not 0 <= args.compute_ms < math.inf:
        raise ConfigError(f"--compute-ms {args.compute_ms:g}: give milliseconds >= 0")
    check_numbers(("--iters", args.iters, 1), ("--min-iters", args.min_iters, 1), ("--warmup", args.warmup, 0))
    gpus = torch.cuda.device_count()
    args.nproc = args.nproc or gpus or 2
    if args.nproc < 2:
        raise ConfigError(f"--nproc {args.nproc}: a collective needs at least 2 ranks")
    limit, what = rank_limit(gpus)
    if args.nproc > limit:
        raise ConfigError(f"--nproc {args.nproc}: more ranks than this machine can start ({what}); use at most {limit}")


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    if args.worker:
        _worker(args)
        return 0
    check(args)
    from disttrain.bench import launch_workers

    code, out = launch_workers(args, "comm")
    if code == 0:
        report(json.loads((out / "comm_raw.json").read_text()), out)
        print((out / "comm.md").read_text())
    return code


def _operation(collective: str, nbytes: int, n: int, device, fresh: bool = False, dtype: str = "float32"):
    """(bytes actually moved, a function running the collective once) on buffers of zeros of `dtype` (no
    denormals, no overflow however often they are summed). `fresh`: the all-gather's output and the reduce-scatter's
    input and output are new tensors at every call, as FSDP2's are."""
    import torch
    import torch.distributed as dist

    kind = getattr(torch, dtype)
    size = kind.itemsize
    count = max(n, nbytes // size // n * n)
    full = torch.zeros(count, device=device, dtype=kind)
    if collective == "all_reduce":
        return count * size, lambda: dist.all_reduce(full)
    if collective == "broadcast":
        return count * size, lambda: dist.broadcast(full, src=0)
    part = torch.zeros(count // n, device=device, dtype=kind)
    if collective == "all_gather" and fresh:
        return count * size, lambda: dist.all_gather_into_tensor(torch.empty_like(full), part)
    if collective == "all_gather":
        return count * size, lambda: dist.all_gather_into_tensor(full, part)
    if collective == "reduce_scatter" and fresh:  # the input copied as FSDP2's chunk_cat copies the gradients in
        return count * size, lambda: dist.reduce_scatter_tensor(torch.empty_like(part), full.clone())
    if collective == "reduce_scatter":
        return count * size, lambda: dist.reduce_scatter_tensor(part, full)
    other = torch.zeros(count, device=device, dtype=kind)
    return count * size, lambda: dist.all_to_all_single(other, full)


HOLD_CYCLES = 2_000_000
"""GPU clock cycles the stream spins before a timed CUDA call (about 1 ms at 1.5-2 GHz): longer than the host takes
to issue the call."""


def _measure(runs: list, iters: list[int], warmup: int, device, before=None
             ) -> tuple[list[list[float]], list[list[float]] | None]:
    """Per-call seconds of the slowest rank for each of `runs`, each call started after a barrier (and `before()`,
    untimed, when given); on a CPU, also the CPU seconds the call took on the process group's own threads (gloo's:
    `backend_threads_seconds`; the rank's thread, which waits, aside), the most of any rank, or None where Linux's
    per-thread figures cannot be read. The sizes take turns (one call of each per round, a size leaving once it has its
    iterations), so that a slow spell of the machine lands on all of them rather than bending the curve at one
    size. On CUDA a call is timed by two events on the caller's stream, which a collective without `async_op` holds
    until nccl's stream has done it; the stream is held busy for about a millisecond before the first event
    (`torch.cuda._sleep`), so that the host has issued the call by the time the device reaches it: the device's time,
    without the host's launch (Python, c10d, the kernel launch: tens of us, which would inflate the small sizes'
    latency, as nccl-tests' own timing does not)."""
    import torch
    import torch.distributed as dist

    from disttrain.bench import backend_threads_seconds

    cuda = device.type == "cuda"
    times: list[list[float]] = [[] for _ in runs]
    cpus: list[list[float]] = [[] for _ in runs]
    readable = torch.tensor([not cuda and backend_threads_seconds() is not None], device=device)
    dist.all_reduce(readable, op=dist.ReduceOp.MIN)  # (CPU seconds from every rank, or from none)
    threads = backend_threads_seconds if readable.item() else None
    for i in range(warmup + max(iters)):
        for k, run in enumerate(runs):
            if i >= warmup + iters[k]:
                continue
            dist.barrier()
            if before is not None:
                before()
            if cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                torch.cuda._sleep(HOLD_CYCLES)
                begin.record()
                run()
                end.record()
                end.synchronize()
                seconds = begin.elapsed_time(end) / 1e3
            else:
                cpu = threads() if threads else 0.0
                start = time.perf_counter()
                run()
                seconds = time.perf_counter() - start
                cpu = threads() - cpu if threads else 0.0
            if i >= warmup:
                times[k].append(seconds)
                cpus[k].append(0.0 if cuda else cpu)
    slowest = torch.tensor([t for ts in times + cpus for t in ts], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    flat = iter(slowest.tolist())
    walls, cpus = [[next(flat) for _ in ts] for ts in times], [[next(flat) for _ in ts] for ts in cpus]
    return walls, cpus if threads else None


def _compute(stop: threading.Event) -> None:
    """Matrix multiplies until `stop` (torch releases the GIL inside them): a rank's compute, for --busy 1."""
    import torch

    a = torch.randn(256, 256)
    while not stop.is_set():
        a @ a


def _phase(ms: float):
    """A function computing for about `ms` milliseconds on the calling thread (matmuls, counted once here)."""
    import torch

    a = torch.randn(256, 256)
    start, k = time.perf_counter(), 0
    while time.perf_counter() - start < 0.1:
        a @ a
        k += 1
    count = round(ms / 1e3 / ((time.perf_counter() - start) / k))

    def compute() -> None:
        for _ in range(count):
            a @ a
    return compute


def _worker(args: argparse.Namespace) -> None:
    import torch

    from disttrain.bench import busy_seconds, other_cpu, own_seconds
    from disttrain.config import DistConfig
    from disttrain.runtime import exit_process, init_runtime, shutdown

    # torch 2.13 renames these two (all_gather_single, reduce_scatter_single); the old names work from 2.4 on
    warnings.filterwarnings("ignore", message=".*(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")
    runtime = init_runtime(DistConfig(nproc=args.nproc, threads_per_rank=1))
    n, rows = runtime.world_size, []
    busy, own, wall = busy_seconds(), own_seconds(), time.perf_counter()
    stop = threading.Event()
    if args.busy == "1":
        threading.Thread(target=_compute, args=(stop,), daemon=True).start()
    step = args.busy == "step"
    before = _phase(args.compute_ms) if step else None
    every = sizes(parse_size(args.min_size, ""), parse_size(args.max_size, ""), args.factor)
    for dtype, collective in [(d, c) for d in args.dtype.split(",") for c in args.collectives.split(",") if c]:
        _measure([_operation(collective, 1024, n, runtime.device, dtype=dtype)[1]], [5], 0, runtime.device)  # (links)
        ops = [_operation(collective, size, n, runtime.device, fresh=step, dtype=dtype) for size in every]
        iters = [iterations(size, args.iters, args.min_iters) for size in every]
        times, cpus = _measure([run for _, run in ops], iters, args.warmup, runtime.device, before)
        rows += [{"collective": collective, "dtype": dtype, "bytes": nbytes, "iterations": k, "times_s": t,
                  **({"cpu_s": cpus[j]} if cpus else {})}
                 for j, ((nbytes, _), k, t) in enumerate(zip(ops, iters, times, strict=True))]
        del ops
    stop.set()
    ours = torch.tensor([own_seconds() - own], dtype=torch.float64, device=runtime.device)  # nccl: CUDA only
    torch.distributed.all_reduce(ours)
    others = other_cpu(busy_seconds() - busy, ours.item(), time.perf_counter() - wall)
    if runtime.is_main_process():
        devices = ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                   if runtime.device.type == "cuda" else [])
        raw = {"backend": runtime.backend, "world_size": n, "device": runtime.device.type, "devices": devices,
               "dtypes": args.dtype.split(","), "rows": rows, "torch": torch.__version__, "host": platform.node(),
               "machine": ", ".join(filter(None, [platform.machine(), f"{len(os.sched_getaffinity(0))} cores",
                                                  platform.processor()])),
               "threads_per_rank": 1, "warmup": args.warmup, "busy": {"0": False, "1": True}.get(args.busy, args.busy),
               **({"compute_ms": args.compute_ms} if step else {}),
               "date": time.strftime("%Y-%m-%d %H:%M:%S"),
               "other_cpu": round(others, 3)}
        (Path(args.out) / "comm_raw.json").write_text(json.dumps(raw))
    shutdown(runtime)
    exit_process(0)


if __name__ == "__main__":
    main()
