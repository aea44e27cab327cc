"""Benchmark: per-step time of the TrainingService vs `disttrain train` on the same job.

    disttrain bench service [--nproc 2] [--steps 40] [--warmup 5] [--repeats 3] [--launcher local] [--out bench_results]

Both sides train the default job (reference GPT, built-in data, global batch 32 in micro-batches of 8
per rank) on `--nproc` ranks with one thread each. `disttrain train`'s step time is what its metrics
record (`step_time_s`: data, forward/backward of every micro-batch, optimizer). The service's step time is
measured in the driver around one step of the loop a user writes: fetch the global batch,
`forward_backward(batch, micro_batch_size=8)` (each rank accumulates over its micro-batches),
`optim_step`. The difference is the service's cost: batches and metrics crossing the wire, one round
trip per call. Runs alternate to share
the machine's drift; the report gives medians after `--warmup` steps and their ratio. Results:
`<out>/service.json` and `<out>/service.md`.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from disttrain.bench import check_numbers
from disttrain.errors import ArgumentParser, ConfigError, make_folder


def _args(argv):
    p = ArgumentParser(prog="disttrain bench service", description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--launcher", default="local", choices=["local", "ray"])
    p.add_argument("--out", default="bench_results")
    return p.parse_args(argv)


JOB = ["dist.threads_per_rank=1", "checkpoint.every=0", "train.eval_every=0", "log.progress=false", "train.log_every=1"]


def train_step_times(args, workdir: Path) -> list[float]:
    """Per-step times of `disttrain train --nproc N` on the default job."""
    run = workdir / f"train_{time.monotonic_ns()}"
    sets = [*JOB, f"train.steps={args.steps}", f"run.out_dir={run}", "run.name=bench"]
    cmd = [sys.executable, "-m", "disttrain", "train", "--nproc", str(args.nproc)]
    for item in sets:
        cmd += ["--set", item]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    records = [json.loads(line) for line in (run / "bench" / "metrics.jsonl").read_text().splitlines() if line]
    return [r["step_time_s"] for r in records if r["step"] > args.warmup]


async def service_step_times(args) -> list[float]:
    """Per-step times of the same job driven through the TrainingService."""
    from dataclasses import asdict

    from disttrain.config import load_config
    from disttrain.data import GlobalSampler, build_datasets, fetch
    from disttrain.service import TrainingService

    cfg = load_config(None, [*JOB, f"train.steps={args.steps}"])
    d = cfg.data
    train, _ = build_datasets(d, cfg.model.seq_len)
    sampler = GlobalSampler(len(train), cfg.run.seed, d.shuffle)
    service = await TrainingService.options(nproc=args.nproc, launcher=args.launcher, threads_per_rank=1).as_service(
        "gpt", model_args=asdict(cfg.model), optimizer=asdict(cfg.optim), strategy="ddp", seed=cfg.run.seed,
        total_steps=cfg.train.steps)
    times = []
    try:
        for step in range(args.steps):
            start = time.perf_counter()
            batch = fetch(train, sampler.global_indices(step * d.global_batch_size, d.global_batch_size))
            await service.forward_backward(batch, micro_batch_size=d.micro_batch_size)  # rank r: r-th slice
            await service.optim_step()
            times.append(time.perf_counter() - start)
    finally:
        await service.shutdown()
    return times[args.warmup:]


def main(argv=None) -> int:
    args = _args(argv or [])
    check_numbers(("--nproc", args.nproc, 1), ("--steps", args.steps, 2), ("--warmup", args.warmup, 0),
                  ("--repeats", args.repeats, 1))
    if args.warmup >= args.steps:
        raise ConfigError(f"--warmup {args.warmup}: must be below --steps {args.steps} (the steps after it are timed)")
    out = make_folder(Path(args.out), "--out")
    train_runs, service_runs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            train_runs.append(statistics.median(train_step_times(args, Path(tmp))))
            service_runs.append(statistics.median(asyncio.run(service_step_times(args))))
            print(f"repeat {repeat + 1}: disttrain train {train_runs[-1] * 1e3:.1f} ms/step, "
                  f"service {service_runs[-1] * 1e3:.1f} ms/step, ratio {service_runs[-1] / train_runs[-1]:.3f}",
                  flush=True)
    ratios = [s / t for s, t in zip(service_runs, train_runs, strict=True)]
    result = {"nproc": args.nproc, "launcher": args.launcher, "steps": args.steps, "warmup": args.warmup,
              "train_ms": [t * 1e3 for t in train_runs], "service_ms": [s * 1e3 for s in service_runs],
              "ratios": ratios, "median_ratio": statistics.median(ratios)}
    (out / "service.json").write_text(json.dumps(result, indent=2))
    lines = ["# TrainingService vs disttrain train (per-step time, default job)", "",
             f"{args.nproc} ranks ({args.launcher} workers), 1 thread each, ddp; median of steps "
             f"{args.warmup + 1}..{args.steps} per run", "",
             "| run | disttrain train ms/step | service ms/step | ratio |", "|---|---|---|---|"]
    lines += [f"| {i + 1} | {t * 1e3:.1f} | {s * 1e3:.1f} | {r:.3f} |"
              for i, (t, s, r) in enumerate(zip(train_runs, service_runs, ratios, strict=True))]
    lines += ["", f"median ratio: **{result['median_ratio']:.3f}**"]
    (out / "service.md").write_text("\n".join(lines) + "\n")
    print(f"median ratio service / disttrain train: {result['median_ratio']:.3f} ({out / 'service.md'})")
    return 0
