"""Benchmark: the cost of scale, i.e. throughput and scaling efficiency of each strategy over world sizes.

Each strategy is measured against its own world-size-1 run and, for ddp, against a hand-written DDP loop timed in
the same processes (in fp32 or bf16-mixed, as the job's `parallel.precision`; under another precision ddp has no
hand-written row).

    disttrain bench scaling [CONFIG] [--set section.key=value ...] [--strategies ddp,zero2,fsdp]
                            [--world-sizes 1,2,4] [--mode weak|strong] [--sweep section.key=v1,v2,...]
                            [--steps 5] [--rounds 4] [--eval-steps 20] [--repeats 1] [--out bench_results/scaling]

weak: the config's `data.global_batch_size` is ONE rank's batch (the global batch is it x the world size, the
micro-batch stays); strong: it is the global batch at every world size, split over the ranks (micro-batch: the
largest divisor of the rank's batch up to data.micro_batch_size, accumulating the rest). Either way efficiency =
tokens/s at w / (w x tokens/s at 1, same strategy and sweep value); targets: 0.90 weak, 0.80 strong. Without
CONFIG the job is `CPU_JOB` (a default run takes a minute or two on 2 cores) or `GPU_JOB`; on CPU every rank runs
1 torch thread (`dist.threads_per_rank = 1` unless the config sets it), pinned to a core of its own where there
are enough.

Each world size is one launch; in it every strategy (and sweep value) runs in turn, in the same processes:
(1) timed: the Trainer's own step (`loops.disttrain_job`), for ddp interleaved in rounds with the hand-written
DDP loop (`loops.plain_loop`), each loop built first for half of the rounds, as `bench overhead` does; a step's
time is the slowest rank's, the row's the median. (2) a fixed run: a fresh model from `run.seed` trained
`--eval-steps` steps (`train.steps` = that, so the schedule completes), then `disttrain.trainer.evaluate` on
`train.eval_samples` validation sequences: the row's `eval_loss`. Every strategy and sweep value gets the same run,
so e.g. a gradient compression's accuracy cost against `none` is in the table.

The in-run figures of each step (perf.py, as every logged line carries them): `comm_exposed_s` (comm_fraction =
comm_exposed_s / step_time_s, median over the timed steps), `comm_bytes` (median per step), `mfu` (median); NaN
where the step does not report one (nothing is timed in one process; `comm_exposed_s` on CUDA). A one-rank row of
a strategy that issues its collectives anyway (DDP, DeepSpeed) counts their bytes, though none crosses a link.
`mem_peak_gib`: the peak of the fixed run, steps and evaluation (perf.peak_memory_gib, reset before it). All are the
max over ranks.

Output (`--out`): scaling.csv, scaling.md (printed at the end) and, with matplotlib, efficiency.png and
throughput.png.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import shlex
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from disttrain.bench import check_numbers, integers, rank_limit
from disttrain.bench.scaling_report import TARGETS
from disttrain.errors import ArgumentParser, ConfigError, make_folder

if TYPE_CHECKING:
    from disttrain.config import Config

CPU_JOB = ("model.n_layer=2", "model.d_model=128", "model.n_head=4", "model.seq_len=64",
           "data.global_batch_size=24", "data.micro_batch_size=4", "train.eval_samples=128")
GPU_JOB = ("model.n_layer=12", "model.d_model=768", "model.n_head=12", "model.seq_len=512",
           "data.global_batch_size=64", "data.micro_batch_size=8", "parallel.precision=bf16-mixed")
NOT_SWEPT = {"parallel.strategy": "--strategies", "dist.nproc": "--world-sizes"}


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(prog="disttrain bench scaling", description=__doc__.split("\n")[0])
    p.add_argument("config", nargs="?", help="TOML config file (default: the bench's CPU or GPU job)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one setting, after CONFIG (repeatable)")
    p.add_argument("--strategies", default="ddp,zero2,fsdp", help="comma-separated registered strategies")
    p.add_argument("--world-sizes", default="", help="comma-separated, with 1 (default: 1, 2, 4, ... up to the cores "
                                                     "on CPU, or the visible GPUs)")
    p.add_argument("--mode", default="weak", help="weak (fixed batch per rank) or strong (fixed global batch)")
    p.add_argument("--sweep", default="", help="section.key=v1,v2,...: one row per value")
    p.add_argument("--steps", type=int, default=5, help="timed optimizer steps per round")
    p.add_argument("--rounds", type=int, default=4, help="interleaved rounds per loop (even)")
    p.add_argument("--eval-steps", type=int, default=20, help="steps of the fixed run that eval_loss comes from")
    p.add_argument("--repeats", type=int, default=1, help="launches per world size, in alternating order; each row "
                                                          "is the median over them (machine noise that drifts)")
    p.add_argument("--out", default="bench_results/scaling")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--base", default="", help=argparse.SUPPRESS)  # the resolved config the driver wrote
    return p.parse_args(argv)


@dataclass
class Plan:
    """What the driver checked before any process starts."""

    base: Config  # the resolved config every row starts from (the batch of world size 1)
    strategies: list[str]
    worlds: list[int]
    sweep_key: str
    sweep_values: list[str]
    cuda: bool
    cores: int


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    if args.worker:
        _worker(args)
        return 0
    from disttrain.bench import scaling_report, worker_entry
    from disttrain.config import save_config
    from disttrain.launch import launch

    plan = make_plan(args)
    out = make_folder(Path(args.out).resolve(), "--out")
    run_dir = make_folder(out / "scaling_run", "--out")
    save_config(plan.base, run_dir / "base.toml")
    worker = argparse.Namespace(base=run_dir / "base.toml", strategies=",".join(plan.strategies), mode=args.mode,
                                sweep=args.sweep, steps=args.steps, rounds=args.rounds, eval_steps=args.eval_steps,
                                out=out)
    load = [os.getloadavg()[0]]
    rows = []
    for repeat in range(args.repeats):  # 1, 2, 3, then 3, 2, 1, ...: a slow drift of the load hits all alike
        for world in plan.worlds if repeat % 2 == 0 else plan.worlds[::-1]:
            (run_dir / f"rows_w{world}.json").unlink(missing_ok=True)
            code = launch(world, worker_entry("disttrain.bench.scaling", worker), run_dir)
            if code:
                return code
            rows += json.loads((run_dir / f"rows_w{world}.json").read_text())
    load.append(os.getloadavg()[0])
    command = "disttrain bench scaling " + shlex.join(sys.argv[1:] if argv is None else argv)
    print(scaling_report.write(rows, plan, args, out, command, load))
    return 0


# ----------------------------------------------------------------------------------------------
# The plan: every check, before any process starts


def make_plan(args: argparse.Namespace) -> Plan:
    import torch

    from disttrain.config import uses_cuda, validate
    from disttrain.parallel import registry

    if args.mode not in TARGETS:
        raise ConfigError(f"--mode {args.mode}: use weak (fixed batch per rank) or strong (fixed global batch)")
    check_numbers(("--steps", args.steps, 1), ("--rounds", args.rounds, 2), ("--eval-steps", args.eval_steps, 1),
                  ("--repeats", args.repeats, 1))
    if args.rounds % 2:
        raise ConfigError(f"--rounds {args.rounds}: must be even (each loop is built first in half of them)")
    try:  # an unknown name is refused naming the valid ones; an alias becomes the strategy's name
        strategies = list(dict.fromkeys(registry.get(name).name for name in args.strategies.split(",") if name))
    except ConfigError as exc:
        raise ConfigError(f"--strategies {args.strategies}: {exc}") from None
    if not strategies:
        raise ConfigError("--strategies is empty; name at least one, e.g. --strategies ddp")
    base = base_config(args.config, args.sets)
    gpus = torch.cuda.device_count()
    for key, value in (("data.micro_batch_size", base.data.micro_batch_size),
                       ("data.global_batch_size", base.data.global_batch_size)):
        if value <= 0:  # (the rows divide by them before each row's config is validated)
            raise ConfigError(f"{key} = {value}: must be > 0")
    cuda = uses_cuda(base, gpus)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    worlds = _world_sizes(args.world_sizes, gpus if cuda else cores, cuda)
    key, values = parse_sweep(args.sweep)
    if key and not any(reads(s, key) for s in strategies):
        raise ConfigError(f"--sweep {key}: none of --strategies {','.join(strategies)} reads it; add one of "
                          f"{', '.join(registry.option_users()[key.split('.', 1)[1]])}")
    for world in worlds:
        for strategy, value in jobs(strategies, key, values):
            validate(row_config(base, strategy, key, value, args.mode, world), gpu_count=gpus, world=world)
    return Plan(base, strategies, worlds, key, values, cuda, cores)


def base_config(path: str | None, sets: list[str]):
    """The config every row starts from: CONFIG (or the bench's job), then --set; on CPU 1 thread per rank."""
    import torch

    from disttrain.config import load_config, uses_cuda

    default = () if path else GPU_JOB if torch.cuda.device_count() and not _cpu_forced(sets) else CPU_JOB
    cfg = load_config(path, [*default, *sets])
    if not uses_cuda(cfg, torch.cuda.device_count()) and cfg.dist.threads_per_rank == 0:
        cfg.dist.threads_per_rank = 1
    cfg.log.progress = False
    return cfg


def _cpu_forced(sets: list[str]) -> bool:
    return any(s.replace(" ", "") == "dist.device=cpu" for s in sets)


def _world_sizes(text: str, devices: int, cuda: bool) -> list[int]:
    if not text:
        worlds = [2**i for i in range(devices.bit_length()) if 2**i <= devices]
        return worlds + ([devices] if devices not in worlds else [])
    worlds = integers(text, "--world-sizes", "world sizes >= 1", "1,2,4")
    if worlds[0] != 1:
        raise ConfigError(f"--world-sizes {text}: must include 1 (efficiency is measured against it), e.g. 1,2,4")
    limit, what = rank_limit(devices if cuda else 0)
    if worlds[-1] > limit:
        raise ConfigError(f"--world-sizes {text}: {worlds[-1]} ranks is more than this machine can start ({what}); "
                          f"use world sizes up to {limit}")
    return worlds


def parse_sweep(text: str) -> tuple[str, list[str]]:
    """(key, values) of --sweep section.key=v1,v2; the key and every value are checked by the config's loader."""
    from disttrain.config import load_config

    if not text:
        return "", []
    key, _, raw = text.partition("=")
    values = [v for v in raw.split(",") if v]
    if not key or not values:
        raise ConfigError(f"--sweep {text}: expected section.key=v1,v2,..., e.g. --sweep parallel.bucket_cap_mb=1,25")
    if key in NOT_SWEPT:
        raise ConfigError(f"--sweep {key}: use {NOT_SWEPT[key]} for that")
    for value in values:
        load_config(None, [f"{key}={value}"])  # unknown key or wrong type: one-line ConfigError
    return key, values


def reads(strategy: str, key: str) -> bool:
    """Whether `strategy` reads setting `key`: every strategy reads the general ones; a strategy-specific
    `parallel.*` setting only its own users (the others would refuse it being set)."""
    from disttrain.parallel import registry

    section, _, name = key.partition(".")
    users = registry.option_users().get(name) if section == "parallel" else None
    return users is None or strategy in users


def jobs(strategies: list[str], key: str, values: list[str]) -> list[tuple[str, str]]:
    """(strategy, sweep value) of every row at one world size; '' where the strategy is not swept."""
    return [(s, v) for s in strategies for v in (values if key and reads(s, key) else [""])]


def row_config(base, strategy: str, key: str, value: str, mode: str, world: int):
    """The config of one row at `world` ranks: strategy, sweep value and the batch of the mode."""
    from disttrain.config import load_config, set_value

    cfg = copy.deepcopy(base)
    set_value(cfg, "parallel.strategy", strategy)
    if value:
        section, _, name = key.partition(".")
        set_value(cfg, key, getattr(getattr(load_config(None, [f"{key}={value}"]), section), name))
    d = cfg.data
    if mode == "weak":
        if d.global_batch_size % d.micro_batch_size:
            raise ConfigError(f"data.global_batch_size = {d.global_batch_size} (one rank's batch in --mode weak) is "
                              f"not divisible by data.micro_batch_size = {d.micro_batch_size}; use a multiple of it")
        d.global_batch_size *= world
    else:
        per_rank, rest = divmod(d.global_batch_size, world)
        if rest:
            raise ConfigError(f"data.global_batch_size = {d.global_batch_size} (the global batch in --mode strong) "
                              f"is not divisible by world size {world}; use a multiple of every --world-sizes value")
        # the largest micro-batch up to the configured one that divides the rank's batch; accumulate the rest
        d.micro_batch_size = max(m for m in range(1, min(d.micro_batch_size, per_rank) + 1) if per_rank % m == 0)
    cfg.dist.nproc = world
    cfg.train.steps, cfg.train.stop_at = 10**6, 0  # timing: the schedule stays at its peak
    return cfg


# ----------------------------------------------------------------------------------------------
# The worker: one world size, every row in the same processes


def _worker(args: argparse.Namespace) -> None:
    from disttrain.bench.loops import PLAIN_PRECISIONS
    from disttrain.bench.predict_job import config_sizes
    from disttrain.config import load_config
    from disttrain.runtime import exit_process, init_runtime, shutdown

    base = load_config(args.base)
    runtime = init_runtime(base.dist, always_form_group=True)
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if runtime.device.type == "cpu" and len(cores) >= runtime.launch.local_world_size:
        os.sched_setaffinity(0, {cores[runtime.local_rank]})  # one core per rank: less scheduler noise
    key, values = parse_sweep(args.sweep)
    rows = []
    for strategy, value in jobs(args.strategies.split(","), key, values):
        cfg = row_config(base, strategy, key, value, args.mode, runtime.world_size)
        plain = strategy == "ddp" and cfg.parallel.precision in PLAIN_PRECISIONS  # what the hand-written loop follows
        for row in _measure(args, cfg, runtime, plain=plain):
            rows.append({"strategy": strategy, "mode": args.mode, "world_size": runtime.world_size,
                         "sweep_key": key if value else "", "sweep_value": value,
                         "global_batch": cfg.data.global_batch_size, "micro_batch": cfg.data.micro_batch_size,
                         "seq_len": cfg.model.seq_len, **config_sizes(cfg.model), **row})
    if runtime.is_main_process():
        path = Path(args.out) / "scaling_run" / f"rows_w{runtime.world_size}.json"
        path.with_suffix(".tmp").write_text(json.dumps(rows))
        path.with_suffix(".tmp").replace(path)
    shutdown(runtime)
    exit_process(0)


def _measure(args, cfg, runtime, plain: bool) -> list[dict]:
    """The disttrain row (and, with `plain`, the hand-written loop's) of one config at this world size."""
    from disttrain.bench.loops import compare, disttrain_loop, plain_loop
    from disttrain.data import GlobalSampler, build_datasets

    train, _ = build_datasets(cfg.data, cfg.model.seq_len)
    sampler = GlobalSampler(len(train), cfg.run.seed, cfg.data.shuffle)
    builders = {"plain": plain_loop, "disttrain": disttrain_loop} if plain else {"disttrain": disttrain_loop}
    results: dict[str, list] = {}
    times = compare(args, cfg, runtime, train, sampler, builders, results)
    gc.collect()
    eval_loss, peak, _ = _fixed_run(args, cfg, runtime, train, sampler)
    stats = step_stats(results["disttrain"], peak)
    names = list(times)
    slowest = _max_over_ranks([t for name in names for t in times[name]] + stats, runtime)
    n = len(times[names[0]])
    step_time = {name: statistics.median(slowest[i * n:(i + 1) * n]) for i, name in enumerate(names)}
    comm_fraction, comm_bytes, mfu, mem = slowest[len(names) * n:]
    rows = [{"loop": "disttrain", "log_every": cfg.train.log_every, "step_time_s": step_time["disttrain"],
             "comm_fraction": comm_fraction, "comm_bytes": comm_bytes, "mfu": mfu, "mem_peak_gib": mem,
             "eval_loss": eval_loss}]
    if plain:
        rows.append({"loop": "hand-written", "log_every": 0, "step_time_s": step_time["plain"]})
    return rows


def step_stats(timed: list[dict], peak_gib: float) -> list[float]:
    """[comm_fraction, comm_bytes, mfu, mem_peak_gib] of one rank: medians over the timed steps' values (perf.py's
    figures, `Trainer._train_step` and the logged line's), NaN where a step does not report a key (e.g. no
    communication is timed), and the fixed run's peak memory."""
    def median(key, of=lambda v, x: x):
        found = [of(v, v[key]) for v in timed if v.get(key) is not None]
        return statistics.median(found) if found else math.nan

    return [median("comm_exposed_s", lambda v, x: x / v["step_time_s"]), median("comm_bytes"), median("mfu"),
            peak_gib]


def _fixed_run(args, cfg, runtime, train, sampler) -> tuple[float, float, list[dict]]:
    """(eval loss, this rank's peak memory in GiB, the steps' values) of `--eval-steps` steps from the seed."""
    from disttrain.bench.loops import disttrain_job
    from disttrain.data import collate
    from disttrain.loader import Loaders
    from disttrain.perf import peak_memory_gib
    from disttrain.trainer import evaluate

    fixed = copy.deepcopy(cfg)
    fixed.train.steps = args.eval_steps
    gc.collect()
    peak_memory_gib(runtime.device)  # resets the peak: what follows is this run's alone
    backend, val, step = disttrain_job(fixed, runtime, train, sampler)
    values = [step(k) for k in range(args.eval_steps)]
    with Loaders(fixed.data, collate, runtime.device, fixed.run.seed) as loaders:
        loss, _ = evaluate(backend, val, runtime, fixed.data.micro_batch_size, fixed.train.eval_samples,
                           batches_of=lambda b: loaders.eval(val, b))
    # each logged step's reading covers the steps since the one before; the last reading, the rest and the evaluation
    peak = max([peak_memory_gib(runtime.device)] + [v["mem_peak_gib"] for v in values if "mem_peak_gib" in v])
    del backend, step
    gc.collect()
    return loss, peak, values


def _max_over_ranks(values: list[float], runtime) -> list[float]:
    """Element-wise max over ranks; NaN (absent) stays NaN unless a rank has the value."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([-1.0 if math.isnan(v) else v for v in values], dtype=torch.float64, device=runtime.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [math.nan if x < 0 else x for x in t.tolist()]


if __name__ == "__main__":
    main()
