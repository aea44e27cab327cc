"""`disttrain bench predict --measure`: weak-scaling step times of the Trainer's own step on this machine, the
measurements the scale model is checked against.

For each world size (one launch each) and strategy: the Trainer's step (`Trainer._setup` + `_train_step`, as `bench
overhead` times it) with a fixed batch per rank (`--local-batch`, accumulated in micro-batches of `--micro-batch`; by
default one micro-batch) and global batch = batch per rank x world size, 1 torch thread per rank, `--warmup` untimed
steps then `--steps` timed ones; the figure is rank 0's median (every step ends in the backend's all-reduce of the
loss totals, so rank 0 waits for the slowest). Under a tensor split (`parallel.tensor` = T), `--local-batch` is a
tensor group's, and the world size 1 is one rank of the split on a fake group of T (tensor_calls.fake_group: its
collectives return at once): the compute of one rank alone, from which the scale model predicts the split's steps.
Under a context split (`parallel.context` = C) likewise, as its last rank (every rank computes as much: the split is
balanced). Under a pipeline (`parallel.pipeline` = P), `--local-batch` is a pipeline group's, and
the world size 1 runs the whole model in one process, its micro-batches accumulated: the compute the stages share.
The rows' `tensor`, `pipeline` and `context` columns say so. Writes `<out>/scaling.csv` with the columns `disttrain
bench scaling` writes (strategy, mode, world_size, global_batch, micro_batch, log_every, params, trained_params,
step_time_s, tokens_per_s) plus step_time_std_s (over the timed steps), cores, `rank_cpu` (a rank's CPU time, gloo's
threads included, over the wall time: 1.0 = a core kept busy) and `other_cpu`: the cores other processes kept busy
during the timed steps (the machine's busy time from /proc/stat less this job's ranks' CPU time, over the wall time).
On a shared machine a row with other_cpu well above 0 measured the neighbours too."""

from __future__ import annotations

import argparse
import csv
import gc
import json
import os
import statistics
import time
from pathlib import Path

from disttrain.errors import ArgumentParser, ConfigError

COLUMNS = ["strategy", "mode", "world_size", "tensor", "pipeline", "context", "global_batch", "micro_batch",
           "log_every", "step_time_s", "step_time_std_s", "tokens_per_s", "params", "trained_params", "cores",
           "rank_cpu", "other_cpu"]


def _overrides(args: argparse.Namespace, world: int, group: int) -> list[str]:
    """The job at `world` ranks: `--local-batch` per data replica (a rank, or a group of `group` ranks that a tensor
    split or a pipeline makes); at 1 rank a pipeline's whole model, its micro-batches accumulated."""
    return [*args.overrides, *(["parallel.pipeline=1", "parallel.pipeline_split="] if world == 1 else []),
            f"data.micro_batch_size={args.micro_batch}",
            f"data.global_batch_size={args.local_batch * max(1, world // group)}", "dist.threads_per_rank=1",
            "log.progress=false", "train.steps=100000", f"run.out_dir={args.out}", "run.name=predict_measure_run"]


def check(args: argparse.Namespace) -> None:
    """--measure's own flags, before anything starts: a batch per rank that is whole micro-batches, world sizes this
    machine can start (on the config's device) and --strategies the scale model knows."""
    import torch

    from disttrain.bench import rank_limit
    from disttrain.bench.predict_job import split_group
    from disttrain.bench.scale_model import SPLIT_NAMES, canonical_strategy
    from disttrain.config import load_config, uses_cuda, validate

    if args.local_batch % args.micro_batch:
        raise ConfigError(f"--local-batch {args.local_batch}: --measure accumulates it in micro-batches of "
                          f"--micro-batch {args.micro_batch}; give a multiple of it")
    gpus, job = torch.cuda.device_count(), load_config(args.config, args.overrides)
    limit, what = rank_limit(gpus if uses_cuda(job, gpus) else 0)
    if args.validate and args.world_sizes[-1] < 2:
        raise ConfigError(f"--world-sizes {','.join(map(str, args.world_sizes))}: --validate predicts steps on 2 ranks "
                          "or more from the 1-rank step; add one, e.g. --world-sizes 1,2")
    if args.world_sizes[-1] > limit:
        raise ConfigError(f"--world-sizes: {args.world_sizes[-1]} ranks is more than this machine can start ({what}); "
                          f"use world sizes up to {limit}")
    try:
        names = [canonical_strategy(s) for s in args.strategies.split(",") if s.strip()]
    except ConfigError as exc:
        raise ConfigError(f"--strategies {args.strategies}: {str(exc).removeprefix('--strategy ')}") from None
    if not names:
        raise ConfigError(f"--strategies {args.strategies!r} names no strategy; e.g. --strategies ddp,fsdp")
    args.strategies = ",".join(dict.fromkeys(names))  # (the ranks run the names the scale model reads back)
    alone, group = job.parallel.tensor * job.parallel.context, split_group(job)  # (alone: a fake group's ranks)
    odd = [w for w in args.world_sizes if w > 1 and w % group]
    if odd:
        raise ConfigError(f"--world-sizes {','.join(map(str, args.world_sizes))}: {odd[0]} ranks do not hold whole "
                          f"groups of {SPLIT_NAMES} = {group}; give 1 and multiples of {group}, "
                          f"e.g. --world-sizes 1,{group}")
    for name in dict.fromkeys(names):  # each strategy's run at each world size, as its ranks will check it
        for world in args.world_sizes:
            try:  # (1 rank of a tensor or context split: the whole group's job, on a fake group: `main`)
                validate(load_config(args.config, [*_overrides(args, world, group), f"parallel.strategy={name}"]),
                         gpus, alone if world == 1 else world)
            except ConfigError as exc:
                raise ConfigError(f"--strategies {name} at {world} rank{'s' if world > 1 else ''}: {exc} (or leave "
                                  f"{name} out of --strategies)") from None


def measure(args: argparse.Namespace, out: Path) -> Path:
    """One launch per world size; returns the CSV written."""
    from disttrain.launch import launch

    rows_file = out / "predict_measure_rows.jsonl"
    rows_file.unlink(missing_ok=True)
    for world in args.world_sizes:
        entry = ["disttrain.bench.predict_measure", f"--strategies={args.strategies}", f"--steps={args.steps}",
                 f"--warmup={args.warmup}", f"--micro-batch={args.micro_batch}",
                 f"--local-batch={args.local_batch}", f"--out={out}",
                 *([args.config] if args.config else []), *[f"--set={o}" for o in args.overrides]]
        code = launch(world, entry, out / "predict_measure_run")
        if code:
            raise SystemExit(code)
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    path = out / "scaling.csv"
    _write(path, rows)
    return path


FIT_SIZES = ("64K", "16M")
"""Message sizes of the sitting's comm fit: the validated GPT's collectives (0.3-13 MB: an FSDP root or block, DDP's
bucket) with a factor of 4 either side. gloo's time is not affine over 1 KiB..256 MiB (its bandwidth peaks at a few
MiB and falls once buffers leave the caches), so a line fitted there misses the sizes the step sends."""


def sitting(args: argparse.Namespace, out: Path, dtypes: list[str]) -> tuple[Path, Path]:
    """`--measure --validate`: `--rounds` R rounds, each the step times of every world size (`measure`) and then a comm
    fit on 2 ranks, in each of `dtypes` (the element types the job sends: `predict_job.wire_dtypes`), timed as a CPU
    step issues its collectives (`disttrain bench comm --busy step`: each call after a
    phase of compute on every rank as long as an FSDP unit's pass, `phase_ms`, into new tensors), so that the step
    times and the links are measured in the same sitting, under the same neighbours. Returns (scaling.csv of every
    round's rows, comm_fit.json of every round's calls pooled: per size, the mean of all rounds' calls). A
    collective's time on a machine whose cores all run ranks is bimodal (a gloo thread that must wait for a core
    costs several ms more), so a median can land on either mode, where the mean, what a step's sum of calls pays,
    moves with their mix; pooling rounds steadies it. (`--busy 1`, a thread computing throughout, fitted by medians,
    moved the fsdp prediction from -27% to +19% between sittings; this way it stayed within -8% / +7% in thirteen:
    docs/benchmarks/predict.md.)"""
    import torch

    from disttrain.bench import comm, comm_report
    from disttrain.bench.tensor_calls import count
    from disttrain.config import load_config, uses_cuda

    cfg = load_config(args.config, args.overrides)
    n_layer, split = cfg.model.n_layer, sum(1 for c in count(cfg) if c.part != "step")  # (a micro-batch's)
    recomputed = cfg.parallel.activation_checkpointing  # (a context split's keys and values each way, gathered again)
    split += (6 if recomputed else 4) * n_layer * (cfg.parallel.context > 1)  # (beside a tensor split's: both)
    split = split or 2 * cfg.parallel.pipeline * (cfg.parallel.pipeline > 1)  # (a stage's send, each way)
    # on GPUs the compute runs on the devices: no host phase; and the links are fitted over every rank measured
    # (nccl picks its algorithm by the number of ranks), where on CPU 2 ranks fit what 3 share (the cores)
    cuda = uses_cuda(cfg, torch.cuda.device_count())
    raws, rows = [], []
    for k in range(args.rounds):
        here = out / f"round{k + 1}"
        here.mkdir(parents=True, exist_ok=True)
        with open(measure(args, here), newline="") as f:
            measured = list(csv.DictReader(f))
        rows += measured
        busy = (["--busy", "0"] if cuda else
                ["--busy", "step", "--compute-ms", f"{phase_ms(measured, n_layer, split):.2f}"])
        code = comm.main([*busy, "--collectives", "all_reduce,all_gather,reduce_scatter", "--dtype", ",".join(dtypes),
                          "--nproc", str(max(args.world_sizes) if cuda else 2), "--min-size", FIT_SIZES[0],
                          "--max-size", FIT_SIZES[1], "--out", str(here / "comm")])
        if code:
            raise SystemExit(code)
        raws.append(json.loads((here / "comm" / "comm_raw.json").read_text()))
    (out / "comm").mkdir(exist_ok=True)
    quiet = [raw for raw in raws if raw["other_cpu"] <= args.max_other_cpu] or raws  # as read_measured does rows
    comm_report.report({**pool(quiet), "fit_statistic": "mean"}, out / "comm")
    path = out / "scaling.csv"
    _write(path, rows)
    return path, out / "comm" / "comm_fit.json"


def phase_ms(rows: list[dict], n_layer: int, split: int = 0) -> float:
    """The compute between two of a step's collectives, the comm fit's `--compute-ms`: the 1-rank step (fsdp's,
    where measured) over the passes of its FSDP units (forward and backward of each block and of the root, in each
    micro-batch), or over `split` collectives a micro-batch (a tensor or context split's; under a pipeline of P,
    2 P: a stage's forward or backward between its sends); 8 ms where no 1-rank step was measured."""
    ones = [r for r in rows if int(r["world_size"]) == 1]
    base = [r for r in ones if r["strategy"] == "fsdp"] or ones
    if not base:
        return 8.0
    micro_steps = int(base[0]["global_batch"]) // int(base[0]["micro_batch"])
    return 1e3 * float(base[0]["step_time_s"]) / ((split or 2 * (n_layer + 1)) * micro_steps)


def pool(raws: list[dict]) -> dict:
    """One `comm_raw.json` of several runs of `disttrain bench comm` with the same sizes and dtypes: each size's calls
    of every run together (the sitting then fits through their means)."""
    def key(r: dict) -> tuple:
        return r.get("dtype", "float32"), r["collective"], r["bytes"]

    pooled = {**raws[-1], "other_cpu": max(r["other_cpu"] for r in raws), "rows": []}
    for row in raws[0]["rows"]:
        same = [r for raw in raws for r in raw["rows"] if key(r) == key(row)]
        pooled["rows"].append({**{k: v for k, v in row.items() if k != "cpu_s"},
                               "iterations": sum(r["iterations"] for r in same),
                               "times_s": [t for r in same for t in r["times_s"]],
                               **({"cpu_s": [t for r in same for t in r["cpu_s"]]}
                                  if all(r.get("cpu_s") for r in same) else {})})
    return pooled


def _write(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def _worker_args(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(prog="disttrain.bench.predict_measure")
    p.add_argument("config", nargs="?")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--strategies", default="ddp,fsdp")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--local-batch", type=int, default=8)
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """A worker (one rank of one world size)."""
    import torch

    from disttrain.bench import busy_seconds, other_cpu, own_seconds
    from disttrain.bench.loops import disttrain_loop
    from disttrain.bench.predict_job import model_sizes, split_group
    from disttrain.bench.tensor_calls import form_fake_group
    from disttrain.config import load_config
    from disttrain.data import GlobalSampler, build_datasets
    from disttrain.models import build_model
    from disttrain.runtime import detect_launch, exit_process, init_runtime, shutdown

    args = _worker_args(argv)
    launched = detect_launch(os.environ)
    world = launched.world_size
    split = load_config(args.config, args.overrides)
    tensor, pipeline, context = split.parallel.tensor, split.parallel.pipeline, split.parallel.context
    cfg = load_config(args.config, _overrides(args, world, split_group(split)))
    environ = os.environ
    if world == 1 and tensor * context > 1:  # one rank of the split, its collectives returning at once: its compute
        rank = (context - 1) * tensor  # (a context split's last rank, tensor rank 0: any would do, all are alike)
        form_fake_group(tensor * context, rank)
        environ = {**os.environ, "WORLD_SIZE": str(tensor * context), "LOCAL_WORLD_SIZE": str(tensor * context),
                   "RANK": str(rank)}
    runtime = init_runtime(cfg.dist, environ, always_form_group=True)
    train, _ = build_datasets(cfg.data, cfg.model.seq_len)
    sampler = GlobalSampler(len(train), cfg.run.seed)
    sizes = model_sizes(build_model(cfg.model))
    for strategy in [s for s in args.strategies.split(",") if s]:
        cfg.parallel.strategy = strategy
        step = disttrain_loop(cfg, runtime, train, sampler)  # the Trainer's step, as bench overhead times it
        times = []
        for k in range(args.warmup + args.steps):
            if k == args.warmup:
                runtime.barrier()
                busy, own, wall = busy_seconds(), own_seconds(), time.perf_counter()
            start = time.perf_counter()
            step(k)
            times.append(time.perf_counter() - start)
        runtime.barrier()
        ours = torch.tensor([own_seconds() - own], dtype=torch.float64, device=runtime.device)  # nccl: CUDA only
        torch.distributed.all_reduce(ours)  # every rank's CPU time, gloo's threads included
        wall = time.perf_counter() - wall
        others = other_cpu(busy_seconds() - busy, ours.item(), wall)
        median = statistics.median(times[args.warmup:])
        if launched.rank == 0:  # (the launch's rank 0: one rank of a split alone is its last rank)
            row = {"strategy": strategy, "mode": "weak", "world_size": world, "tensor": tensor, "pipeline": pipeline,
                   "context": context,
                   "global_batch": cfg.data.global_batch_size,
                   "micro_batch": args.micro_batch, "log_every": cfg.train.log_every, "step_time_s": median,
                   "step_time_std_s": statistics.stdev(times[args.warmup:]) if args.steps > 1 else 0.0,
                   "tokens_per_s": cfg.data.global_batch_size * cfg.model.seq_len / median, **sizes,
                   "cores": len(os.sched_getaffinity(0)), "rank_cpu": round(ours.item() / world / wall, 3),
                   "other_cpu": round(others, 3)}
            with open(Path(args.out) / "predict_measure_rows.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
        del step
        gc.collect()
        runtime.barrier()
    shutdown(runtime)
    exit_process(0)


if __name__ == "__main__":
    main()
