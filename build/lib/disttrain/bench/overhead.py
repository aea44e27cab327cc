"""Benchmark: disttrain's step vs the same strategy written by hand in plain PyTorch, same model, data
and threads, and vs itself without its in-run figures; for several strategies, also each strategy's step time
relative to ddp.

    disttrain bench overhead [--strategies ddp,zero1,zero2,fsdp,hsdp,deepspeed,pp2,pp2-gpipe,tp2] [--nproc 2]
                             [--rounds 8] [--steps 10] [--profile STEPS] [--set SECTION.KEY=VALUE ...]

`--set` changes the job both loops train: the model, the data, AdamW's and the schedule's settings, DDP's bucket size,
the DeepSpeed stage (`FOLLOWED`); anything else would change disttrain's side alone and is refused.

Besides the strategies, `--strategies` takes model-parallel layouts over all `--nproc` ranks (N = --nproc):
`ppN` = parallel.pipeline = N with the 1f1b schedule, `ppN-gpipe` the same with GPipe, `tpN` = parallel.tensor = N.
Their hand-written loops are in bench/plain_model_parallel.py; both sides run them without clipping
(optim.grad_clip = 0), as the pipelining and tensor-parallel tutorials do.

A third loop is disttrain's step without its in-run figures (`loops.bare_loop`: no communication meter on the
strategy's collectives, no gather of the ranks' figures), so that their own cost is measured too: disttrain /
disttrain without them (the issue's figure, target <= 1.02).

The loops run in the same processes, interleaved in rounds (A B C C B A ...) so that machine noise hits
them alike, built in one order for half of the rounds and in the reverse order for the other half (every pair in
both orders). The figure is the ratio of median step
times, disttrain / plain (target <= 1.02). Results go to `<out>/overhead.json` and `<out>/overhead.md`
with the config and versions. `--profile STEPS` adds, per strategy, where rank 0's time goes (`host_profile`,
after all the timed rounds): each loop's wall and host time per step under torch.profiler (and on a GPU its device
time and CUDA calls), and the operators that differ most.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import statistics
import time
from pathlib import Path

import torch

from disttrain.bench import loops
from disttrain.errors import ArgumentParser, make_folder


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(prog="disttrain bench overhead", description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--strategies", default="ddp", help="comma-separated: ddp, zero1, zero2, fsdp, hsdp, deepspeed, "
                   "and layouts over all --nproc ranks: ppN (pipeline, 1f1b), ppN-gpipe, tpN (tensor)")
    p.add_argument("--rounds", type=int, default=8, help="interleaved rounds per loop (even)")
    p.add_argument("--steps", type=int, default=10, help="timed optimizer steps per round")
    p.add_argument("--micro", type=int, default=16, help="micro-batch per rank")
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="also profile STEPS steps of each loop (built first, then second) per strategy and report "
                        "where rank 0's time goes: host time, CUDA calls, the operators that differ most (0: none)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one setting of the job (repeatable), e.g. --set model.d_model=256")
    p.add_argument("--out", default="bench_results")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


OWNED = {"data.global_batch_size": "use --global-batch", "data.micro_batch_size": "use --micro",
         "dist.nproc": "use --nproc", "parallel.strategy": "use --strategies", "run.out_dir": "use --out",
         "optim.name": "the hand-written loops use AdamW"}
"""Settings `--set` refuses with a reason: the bench's own flags give them, or the hand-written loops cannot follow."""

FOLLOWED = ("model.", "data.", "optim.", "parallel.bucket_cap_mb", "parallel.deepspeed_stage", "run.seed",
            "train.log_every", "log.peak_tflops")
"""What `--set` may change: settings both loops follow (the hand-written ones read the model, the data, AdamW's and
the schedule's settings, DDP's bucket size and the DeepSpeed stage; the last three change only disttrain's figures).
Any other setting would change disttrain's side alone."""


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    if args.worker:
        _worker(args)
        return 0
    from disttrain.bench import launch_workers

    check_strategies(args)
    code, out = launch_workers(args, "overhead")
    if code == 0:
        print((out / "overhead.md").read_text())
    return code


LAYOUT = re.compile(r"pp(?P<pp>[0-9]+)(?P<gpipe>-gpipe)?|tp(?P<tp>[0-9]+)")
"""A model-parallel layout in --strategies: ppN, ppN-gpipe, tpN."""


def settings(name: str) -> list[str]:
    """The config overrides of one --strategies entry: a strategy's name, or a layout's `parallel.*` settings (the
    data-parallel strategy ddp, idle when the layout takes every rank) and no clipping, as in the hand-written loops."""
    found = LAYOUT.fullmatch(name)
    if found is None:
        return [f"parallel.strategy={name}"]
    split = ([f"parallel.pipeline={found['pp']}",
              f"parallel.pipeline_schedule={'gpipe' if found['gpipe'] else '1f1b'}"] if found["pp"] else
             [f"parallel.tensor={found['tp']}"])
    return ["parallel.strategy=ddp", "optim.grad_clip=0", *split]


def check_strategies(args: argparse.Namespace) -> None:
    """The counts, and every --strategies entry against the registry, the layouts and the config's validation, before
    any process starts: ConfigError (one line) naming the flag or entry and the fix."""
    from disttrain.bench import check_numbers, rank_limit
    from disttrain.config import validate
    from disttrain.errors import ConfigError
    from disttrain.parallel import registry

    check_numbers(("--rounds", args.rounds, 2), ("--steps", args.steps, 1), ("--nproc", args.nproc, 1),
                  ("--profile", args.profile, 0))
    given = {item.partition("=")[0].strip(): item for item in args.set}
    for key, item in given.items():
        if key in OWNED:
            raise ConfigError(f"--set {item}: the bench cannot take {key} ({OWNED[key]}); leave it out")
        if not key.startswith(FOLLOWED):
            raise ConfigError(f"--set {item}: the hand-written loops would not follow {key}; --set takes "
                              f"{', '.join(k + '*' if k.endswith('.') else k for k in FOLLOWED)}")
    if args.rounds % 2:
        raise ConfigError(f"--rounds {args.rounds}: must be even (each loop is built first in half of them)")
    import torch

    from disttrain.config import uses_cuda

    cfg, gpus = job_config(args), torch.cuda.device_count()  # the ranks run where the job does: a GPU each, if any
    limit, what = rank_limit(gpus if uses_cuda(cfg, gpus) else 0)
    if args.nproc > limit:
        raise ConfigError(f"--nproc {args.nproc}: more ranks than this machine can start ({what}); use at most {limit}")
    validate(cfg, gpus, args.nproc)  # the job as --set leaves it (its message names the setting)
    names = [s for s in args.strategies.split(",") if s]
    if not names:
        raise ConfigError("--strategies is empty; name at least one, e.g. --strategies ddp,pp2,tp2")
    for name in names:
        found = LAYOUT.fullmatch(name)
        degree = int(found["pp"] or found["tp"]) if found else None
        fixed = [given[k] for k in (x.partition("=")[0] for x in settings(name)) if k in given]
        if found and fixed:
            raise ConfigError(f"--set {fixed[0]}: --strategies {name} sets it (as the hand-written loop runs); leave "
                              "it out, or name another layout")
        if found is None and name not in [*registry.names(), *registry.aliases()]:
            raise ConfigError(f"--strategies {name}: unknown; use a strategy ({', '.join(registry.names())}) or a "
                              f"layout over all ranks: pp{args.nproc}, pp{args.nproc}-gpipe, tp{args.nproc}")
        if degree is not None and degree != args.nproc:
            raise ConfigError(f"--strategies {name}: the layout's degree {degree} must equal --nproc {args.nproc} (the "
                              f"hand-written loops split the model over every rank); use {name[:2]}{args.nproc} or "
                              f"--nproc {degree}")
        try:
            validate(job_config(args, name), gpus, args.nproc)
        except ConfigError as exc:
            raise ConfigError(f"--strategies {name}: {exc}") from None


def job_config(args: argparse.Namespace, strategy: str = "ddp", extra: tuple[str, ...] = ()):
    from disttrain.config import load_config

    return load_config(None, [*getattr(args, "set", ()), f"data.global_batch_size={args.global_batch}",
                              f"data.micro_batch_size={args.micro}",
                              "dist.threads_per_rank=1", "log.progress=false", "train.steps=100000",
                              f"dist.nproc={args.nproc}", f"run.out_dir={args.out}", "run.name=overhead_run",
                              *settings(strategy), *extra])


def host_profile(cfg, runtime, train, sampler, steps: int = 10, top: int = 8) -> dict[str, str]:
    """Where each loop's time goes, per step of the hand-written loop and of disttrain's, each profiled for `steps`
    steps (after 3 unprofiled ones) built first and again built second (whichever loop is built second runs
    slower: loops.compare): the wall time; the host time in operators and in the CUDA runtime and driver calls
    they make; those calls by name (launches, copies, synchronisations); the `top` host operators whose host time
    differs most; on a GPU the device's time in kernels and the `top` kernels whose time differs most."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    cuda = runtime.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    builds = {"hand-written": loops.plain_loop, "disttrain": loops.disttrain_loop}
    walls = {name: 0.0 for name in builds}
    seen: dict[str, dict[str, list]] = {name: {} for name in builds}  # key -> [host us, calls, device us, kind]
    for order in (list(builds), list(builds)[::-1]):
        for name in order:
            step = builds[name](cfg, runtime, train, sampler)
            for k in range(3):
                step(k)
            _sync(runtime.device)
            if torch.distributed.is_initialized():
                torch.distributed.barrier()  # the profiled steps start together on every rank, as loops.compare's
            # one cycle, no schedule: acc_events only quiets torch's warning that a cycle's end clears them
            with profiler(activities=activities, acc_events=True) as prof:
                start = time.perf_counter()
                for k in range(3, 3 + steps):
                    step(k)
                _sync(runtime.device)
                walls[name] += (time.perf_counter() - start) / (2 * steps)
            for e in prof.key_averages():
                # a kernel's time also shows on the operator that launched it and on annotations around it: count
                # device time on the kernels alone (as torch's own table totals do), host time on host events
                kernel = e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False)
                kind = "kernel" if kernel else "host"
                row = seen[name].setdefault(e.key, [0.0, 0.0, 0.0, kind])
                row[0] += 0.0 if kernel else e.self_cpu_time_total / (2 * steps)
                row[1] += e.count / (2 * steps)
                row[2] += e.self_device_time_total / (2 * steps) if kernel else 0.0
            del step, prof
            gc.collect()
    a, b = seen["hand-written"], seen["disttrain"]

    def of(ops, key, i):
        return ops[key][i] if key in ops else 0.0

    def keys(kind):
        return sorted(k for k in {*a, *b} if (a.get(k) or b.get(k))[3] == kind)

    def total_ms(ops, i):  # self times: each microsecond counted once
        return sum(v[i] for v in ops.values()) / 1e3

    def most_different(kind, i):
        ranked = sorted(keys(kind), key=lambda k: -abs(of(b, k, i) - of(a, k, i)))[:top]
        return "; ".join(f"{k} {of(a, k, i):.0f} / {of(b, k, i):.0f} ({of(a, k, 1):g} / {of(b, k, 1):g})"
                         for k in ranked)

    calls = [k for k in keys("host") if k.startswith("cu")]  # cudaLaunchKernel, cudaMemcpyAsync, cuLaunchKernel...
    figures = {
        "profiled, per step (hand-written / disttrain)": (
            f"{walls['hand-written'] * 1e3:.2f} / {walls['disttrain'] * 1e3:.2f} ms wall under the profiler, "
            f"{total_ms(a, 0):.2f} / {total_ms(b, 0):.2f} ms of host time in operators"
            + (f", {total_ms(a, 2):.2f} / {total_ms(b, 2):.2f} ms of device time in kernels" if cuda else "")
            + f"; {steps} steps each, built first and built second"),
        "CUDA runtime calls per step (hand-written / disttrain)": ", ".join(
            f"{k} {of(a, k, 1):g} / {of(b, k, 1):g}" for k in calls) or "none (no CUDA)",
        "host time per step, the operators that differ most (hand-written / disttrain, us; calls)":
            most_different("host", 0)}
    if cuda:
        figures["device time per step, the kernels that differ most (hand-written / disttrain, us; calls)"] = (
            most_different("kernel", 2))
    return figures


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def start_worker(cfg):
    """(runtime, training set, sampler) of a benchmark's rank: the process group, one core per rank where the cores
    suffice (less scheduler noise in the figures), the data stream."""
    from disttrain.data import GlobalSampler, build_datasets
    from disttrain.runtime import init_runtime

    runtime = init_runtime(cfg.dist, always_form_group=True)  # --nproc 1: DDP / FSDP over a one-rank group
    cores = sorted(os.sched_getaffinity(0))
    if runtime.device.type == "cpu" and len(cores) >= runtime.launch.local_world_size:  # (a GPU rank's host
        os.sched_setaffinity(0, {cores[runtime.local_rank]})  # threads, nccl's among them, keep every core)
    train, _ = build_datasets(cfg.data, cfg.model.seq_len)
    return runtime, train, GlobalSampler(len(train), cfg.run.seed)


def _worker(args: argparse.Namespace) -> None:
    from disttrain.runtime import exit_process, shutdown

    cfg = job_config(args)
    runtime, train, sampler = start_worker(cfg)
    strategies = [s for s in args.strategies.split(",") if s]
    times = {s: loops.compare(args, job_config(args, s), runtime, train, sampler) for s in strategies}
    profiles = {s: host_profile(job_config(args, s), runtime, train, sampler, args.profile) for s in strategies
                if args.profile}  # after every comparison: none times steps after a profile
    if runtime.is_main_process():
        _report(args, cfg, times, profiles, runtime.backend)
    shutdown(runtime)
    exit_process(0)


def _report(args, cfg, times: dict[str, dict[str, list[float]]], profiles: dict[str, dict[str, str]],
            backend: str) -> None:
    from disttrain._version import __version__

    med = {s: {loop: statistics.median(t) for loop, t in by_loop.items()} for s, by_loop in times.items()}
    rows, figures = [], {}
    for strategy, m in med.items():
        ratio, cost = m["disttrain"] / m["plain"], m["disttrain"] / m["bare"]
        vs_ddp = m["disttrain"] / med["ddp"]["disttrain"] if "ddp" in med else float("nan")
        figures[strategy] = {"plain_s": m["plain"], "disttrain_s": m["disttrain"], "bare_s": m["bare"],
                             "ratio_vs_plain": ratio, "figures_cost": cost, "disttrain_vs_ddp": vs_ddp}
        rows.append(f"| {strategy} | {m['plain'] * 1e3:.1f} | {m['disttrain'] * 1e3:.1f} | **{ratio:.3f}** | "
                    f"{m['bare'] * 1e3:.1f} | **{cost:.3f}** | {vs_ddp:.2f} |")
    steps = len(next(iter(times.values()))["plain"])
    result = {"strategies": figures, "ratio_disttrain_over_plain": figures[next(iter(figures))]["ratio_vs_plain"],
              "steps_per_loop": steps, "nproc": args.nproc, "micro_batch": args.micro,
              "global_batch": args.global_batch, "model": vars(cfg.model), "threads_per_rank": 1, "profile": profiles,
              "torch": torch.__version__, "disttrain": __version__,
              "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    out = make_folder(Path(args.out), "--out")
    (out / "overhead.json").write_text(json.dumps(result, indent=2))
    m = cfg.model
    (out / "overhead.md").write_text(
        f"# disttrain step time vs the same strategy written by hand ({result['date']})\n\n"
        "| strategy | hand-written (ms) | disttrain (ms) | ratio disttrain / hand-written | disttrain without its "
        "figures (ms) | the figures' cost | vs ddp |\n"
        "|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n"
        "Target: ratio <= 1.00 for every strategy (disttrain no slower than the loop written by hand); <= 1.03 for "
        "the model-parallel layouts. The figures' cost: disttrain's step as it runs (the communication meter on the "
        "strategy's collectives; every `train.log_every` steps a gather of the ranks' step times and peak memory) "
        "over the same step without them; target <= 1.02.\n\n"
        + (_LAYOUTS_NOTE if any(LAYOUT.fullmatch(s) for s in times) else "") +
        f"{args.nproc} ranks x 1 thread, {backend}; GPT {m.n_layer} layers, d_model {m.d_model}, seq_len "
        f"{m.seq_len}; micro-batch {args.micro}, global batch {args.global_batch}; {steps} timed steps per loop "
        f"in {args.rounds} interleaved rounds; torch {torch.__version__}, disttrain {__version__}, "
        f"Python {platform.python_version()}.\n" + "".join(
            f"\n## Where {strategy}'s time goes (rank 0, profiled)\n\n" + "".join(f"- {k}: {v}\n" for k, v in
                                                                              found.items())
            for strategy, found in profiles.items()))


_LAYOUTS_NOTE = (
    "Layouts over all ranks: ppN = parallel.pipeline = N (schedule 1f1b; ppN-gpipe: GPipe) against a hand-written "
    "torch.distributed.pipelining loop (one stage per rank, static shapes, Schedule1F1B/ScheduleGPipe with "
    "scale_grads=False and a token-sum loss, the tied embedding gradient summed between first and last stage, "
    "gradients divided by the token count, AdamW); tpN = parallel.tensor = N against parallelize_module with "
    "ColwiseParallel (q, k, v, mlp.0, the head) and RowwiseParallel (proj, mlp.2, the embedding), AdamW. Every rank "
    "reads the whole global batch; both sides run without clipping (optim.grad_clip = 0).\n\n")


if __name__ == "__main__":
    main()
