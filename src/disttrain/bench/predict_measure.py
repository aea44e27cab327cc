"""`disttrain bench predict --measure`: weak-scaling step times of the Trainer's own step on this machine, the
measurements the scale model is checked against.

For each world size (one launch each) and strategy: the Trainer's step (`Trainer._setup` + `_train_step`, as
`bench overhead` times it) with a fixed micro-batch per rank and global batch = micro-batch x world size (no
accumulation), 1 torch thread per rank, `--warmup` untimed steps then `--steps` timed ones; the figure is rank 0's
median (every step ends in the backend's all-reduce of the loss totals, so rank 0 waits for the slowest).
Writes `<out>/scaling.csv` with the columns `disttrain bench scaling` writes (strategy, mode, world_size,
global_batch, micro_batch, step_time_s, tokens_per_s) plus params, cores and `other_cpu`: the cores other processes
kept busy during the timed steps (the machine's busy time from /proc/stat less this job's ranks' CPU time, over the
wall time). On a shared machine a row with other_cpu well above 0 measured the neighbours too.
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import os
import statistics
import time
from pathlib import Path

COLUMNS = ["strategy", "mode", "world_size", "global_batch", "micro_batch", "step_time_s", "tokens_per_s", "params",
           "cores", "other_cpu"]


def _overrides(args: argparse.Namespace, world: int) -> list[str]:
    return [*args.overrides, f"data.micro_batch_size={args.micro_batch}",
            f"data.global_batch_size={args.micro_batch * world}", "dist.threads_per_rank=1", "log.progress=false",
            "train.steps=100000", f"run.out_dir={args.out}", "run.name=predict_measure_run"]


def measure(args: argparse.Namespace, out: Path) -> Path:
    """One launch per world size; returns the CSV written."""
    from disttrain.launch import launch

    rows_file = out / "predict_measure_rows.jsonl"
    rows_file.unlink(missing_ok=True)
    for world in args.world_sizes:
        entry = ["disttrain.bench.predict_measure", f"--strategies={args.strategies}", f"--steps={args.steps}",
                 f"--warmup={args.warmup}", f"--micro-batch={args.micro_batch}", f"--out={out}",
                 *([args.config] if args.config else []), *[f"--set={o}" for o in args.overrides]]
        code = launch(world, entry, out / "predict_measure_run")
        if code:
            raise SystemExit(code)
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    path = out / "scaling.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    return path


def _worker_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="disttrain.bench.predict_measure")
    p.add_argument("config", nargs="?")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--strategies", default="ddp,fsdp")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """A worker (one rank of one world size)."""
    import torch

    from disttrain.bench import busy_seconds, other_cpu, own_seconds
    from disttrain.bench.overhead import _disttrain_loop
    from disttrain.config import load_config
    from disttrain.data import GlobalSampler, build_datasets
    from disttrain.models import build_model
    from disttrain.runtime import detect_launch, exit_process, init_runtime, shutdown

    args = _worker_args(argv)
    world = detect_launch(os.environ).world_size
    cfg = load_config(args.config, _overrides(args, world))
    runtime = init_runtime(cfg.dist, always_form_group=True)
    train, _ = build_datasets(cfg.data, cfg.model.seq_len)
    sampler = GlobalSampler(len(train), cfg.run.seed)
    params = sum(p.numel() for p in build_model(cfg.model).parameters())
    for strategy in [s for s in args.strategies.split(",") if s]:
        cfg.parallel.strategy = strategy
        step = _disttrain_loop(cfg, runtime, train, sampler)  # the Trainer's step, as bench overhead times it
        times = []
        for k in range(args.warmup + args.steps):
            if k == args.warmup:
                runtime.barrier()
                busy, own, wall = busy_seconds(), own_seconds(), time.perf_counter()
            start = time.perf_counter()
            step(k)
            times.append(time.perf_counter() - start)
        runtime.barrier()
        ours = torch.tensor([own_seconds() - own], dtype=torch.float64)
        torch.distributed.all_reduce(ours)  # every rank's CPU time, gloo's threads included
        others = other_cpu(busy_seconds() - busy, ours.item(), time.perf_counter() - wall)
        median = statistics.median(times[args.warmup:])
        if runtime.is_main_process():
            row = {"strategy": strategy, "mode": "weak", "world_size": world, "global_batch": args.micro_batch * world,
                   "micro_batch": args.micro_batch, "step_time_s": median,
                   "tokens_per_s": args.micro_batch * world * cfg.model.seq_len / median, "params": params,
                   "cores": len(os.sched_getaffinity(0)), "other_cpu": round(others, 3)}
            with open(Path(args.out) / "predict_measure_rows.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
        del step
        gc.collect()
        runtime.barrier()
    shutdown(runtime)
    exit_process(0)


if __name__ == "__main__":
    main()
