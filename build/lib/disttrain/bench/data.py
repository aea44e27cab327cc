"""Benchmark: the data path's cost and what worker processes buy, on the default job in one process.

    disttrain bench data [--rounds 6] [--steps 12] [--sleep-ms 2] [--workers 2] [--out bench_results]

(a) `loader` vs `direct`: the Trainer's step with batches from the DataLoader (`data.num_workers = 0`) against
    the old path, `fetch(dataset, indices)` in the training thread; target ratio <= 1.01.
(b) A dataset whose items cost `--sleep-ms` each (time.sleep in `__getitem__`, as a slow transform or read
    would): step time with `--workers` worker processes vs none; target ratio <= 0.6. Workers can only hide the
    data time behind the step's compute, so this runs a model whose step costs about as much as the data
    (`--slow-model`, default 1 layer x 32); on the default job (~0.5-1 s per step on one CPU thread) 64 ms of
    data per step is a few percent whatever the workers do.

The variants of a pair train the same backend (the step's cost does not depend on the weights), interleaved in
rounds (A B B A ...); a round's first step is not timed (it starts the workers). The figure is the ratio of
median step times. Results go to `<out>/data_loader.json` and `<out>/data_loader.md`.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from disttrain.errors import ArgumentParser, ConfigError, make_folder


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(prog="disttrain bench data", description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=6, help="interleaved rounds per variant (even)")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps per round (the first is not timed)")
    p.add_argument("--sleep-ms", type=float, default=2.0, help="cost of one item of the slow dataset")
    p.add_argument("--workers", type=int, default=2, help="data.num_workers of the slow dataset's worker variant")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the training process")
    p.add_argument("--slow-model", default="model.n_layer=1,model.d_model=32,model.n_head=2",
                   help="comma-separated overrides of the model used for (b)")
    p.add_argument("--out", default="bench_results")
    return p.parse_args(argv)


class SlowItems(Dataset):
    """Another dataset's items, each after `sleep_s` (a stand-in for a slow transform or read)."""

    def __init__(self, inner: Dataset, sleep_s: float):
        self.inner, self.sleep_s = inner, sleep_s

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> Any:
        time.sleep(self.sleep_s)
        return self.inner[i]


def _step_times(backend, batches_of_step, steps: int) -> list[float]:
    """Per-step times of the Trainer's step: the step's micro-batches, forward_backward each, optim_step."""
    times = []
    for k in range(steps):
        start = time.perf_counter()
        micro = batches_of_step(k)
        for i, batch in enumerate(micro):
            backend.forward_backward(batch, sync=i == len(micro) - 1)
        backend.optim_step()
        times.append(time.perf_counter() - start)
    return times[1:]


def _round(variant: str, backend, cfg, train, sampler, args, cursor: int) -> list[float]:
    from disttrain.data import collate, fetch
    from disttrain.loader import Loaders, StepBatches

    d = cfg.data
    steps = StepBatches(sampler, cursor, args.steps, d.global_batch_size, d.micro_batch_size, 1, 0)
    if variant == "direct":
        return _step_times(backend, lambda k: [fetch(train, idx) for idx in steps.step(k)], args.steps)
    workers = args.workers if variant.endswith("workers") else 0
    dataset = SlowItems(train, args.sleep_ms / 1e3) if variant.startswith("slow") else train
    data_cfg = type(d)(**{**vars(d), "num_workers": workers})
    with Loaders(data_cfg, collate, torch.device("cpu"), cfg.run.seed) as loaders:
        batches = loaders.train(dataset, steps)
        micro = len(steps.step(0))
        return _step_times(backend, lambda k: [next(batches) for _ in range(micro)], args.steps)


PAIRS = (("direct", "loader"), ("slow", "slow_workers"))


def _data_only(cfg, train, sampler, steps: int) -> dict[str, float]:
    """Seconds per step spent producing the step's batches alone (no model): direct fetch vs the DataLoader with
    0 workers. Free of the model's step-time noise, this is the data path's own cost."""
    from disttrain.data import collate, fetch
    from disttrain.loader import Loaders, StepBatches

    d = cfg.data
    out = {}
    for variant in ("direct", "loader", "direct", "loader"):
        batches = StepBatches(sampler, 0, steps, d.global_batch_size, d.micro_batch_size, 1, 0)
        start = time.perf_counter()
        if variant == "direct":
            for k in range(steps):
                [fetch(train, idx) for idx in batches.step(k)]
        else:
            with Loaders(d, collate, torch.device("cpu"), cfg.run.seed) as loaders:
                for _ in loaders.train(train, batches):
                    pass
        out[variant] = min(out.get(variant, float("inf")), (time.perf_counter() - start) / steps)
    return out


def main(argv: list[str] | None = None) -> int:
    from disttrain.backend import create_backend
    from disttrain.bench import check_numbers
    from disttrain.config import load_config, validate
    from disttrain.data import GlobalSampler, build_datasets
    from disttrain.models import build_model
    from disttrain.optim import optimizer_factory, scheduler_factory
    from disttrain.runtime import init_runtime
    from disttrain.trainer import seed_everything

    args = _args(argv)
    check_numbers(("--rounds", args.rounds, 1), ("--steps", args.steps, 2), ("--sleep-ms", args.sleep_ms, 0),
                  ("--workers", args.workers, 0), ("--threads", args.threads, 1))
    slow = [s for s in args.slow_model.split(",") if s]
    try:
        validate(load_config(None, slow))
    except ConfigError as exc:
        raise ConfigError(f"--slow-model {args.slow_model}: {exc}") from None
    make_folder(Path(args.out), "--out")  # (before the rounds: a path that cannot be a folder ends them unrun)
    torch.set_num_threads(args.threads)
    runtime = None
    jobs = []
    for overrides in ([], slow):  # (a) the default job, (b) a small model
        cfg = load_config(None, ["train.steps=100000", "log.progress=false", *overrides])  # schedule far away
        seed_everything(cfg.run.seed)
        runtime = runtime or init_runtime(cfg.dist)
        backend = create_backend(build_model(cfg.model), optimizer_factory(cfg.optim), cfg.parallel,
                                 runtime=runtime, grad_clip=cfg.optim.grad_clip,
                                 scheduler_factory=scheduler_factory(cfg.optim, cfg.train.steps, False))
        train, _ = build_datasets(cfg.data, cfg.model.seq_len)
        jobs.append((backend, cfg, train, GlobalSampler(len(train), cfg.run.seed, cfg.data.shuffle)))
    times: dict[str, list[float]] = {v: [] for pair in PAIRS for v in pair}
    cursor = 0
    for r in range(args.rounds):
        for pair, job in zip(PAIRS, jobs, strict=True):
            for variant in (pair if r % 2 == 0 else pair[::-1]):  # A B, then B A: each goes first half the time
                times[variant] += _round(variant, *job, args, cursor)
                cursor += args.steps * job[1].data.global_batch_size
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{v} {statistics.median(t) * 1e3:.1f} ms" for v, t in times.items()), flush=True)
    data_only = _data_only(jobs[0][1], jobs[0][2], jobs[0][3], steps=200)
    _report(args, jobs[0][1], jobs[1][1], times, data_only)
    return 0


def _report(args, cfg, slow_cfg, times: dict[str, list[float]], data_only: dict[str, float]) -> None:
    from disttrain._version import __version__

    med = {v: statistics.median(t) for v, t in times.items()}
    result = {"median_step_s": med, "steps_timed_per_variant": len(times["direct"]),
              "ratio_loader_over_direct": med["loader"] / med["direct"],
              "ratio_workers_over_none": med["slow_workers"] / med["slow"],
              "data_only_s_per_step": data_only,
              "data_only_overhead_fraction_of_step": (data_only["loader"] - data_only["direct"]) / med["direct"],
              "sleep_ms_per_item": args.sleep_ms, "workers": args.workers, "threads": args.threads,
              "rounds": args.rounds, "model": vars(cfg.model), "slow_model": vars(slow_cfg.model),
              "global_batch": cfg.data.global_batch_size,
              "micro_batch": cfg.data.micro_batch_size, "torch": torch.__version__, "disttrain": __version__,
              "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    out = Path(args.out)
    (out / "data_loader.json").write_text(json.dumps(result, indent=2))
    m, d = cfg.model, cfg.data
    text = (
        f"# The data path: DataLoader vs direct fetch, and worker processes ({result['date']})\n\n"
        "| comparison | ms/step | ms/step | ratio | target |\n|---|---|---|---|---|\n"
        f"| DataLoader (0 workers) / direct fetch | {med['loader'] * 1e3:.1f} | {med['direct'] * 1e3:.1f} | "
        f"**{result['ratio_loader_over_direct']:.3f}** | <= 1.01 |\n"
        f"| {args.sleep_ms:g} ms/item dataset: {args.workers} workers / 0 workers | {med['slow_workers'] * 1e3:.1f} | "
        f"{med['slow'] * 1e3:.1f} | **{result['ratio_workers_over_none']:.3f}** | <= 0.6 |\n\n"
        f"The data path alone (no model; best of 2 x 200 steps): direct fetch {data_only['direct'] * 1e3:.3f} ms/step, "
        f"DataLoader {data_only['loader'] * 1e3:.3f} ms/step: the loader adds "
        f"{result['data_only_overhead_fraction_of_step'] * 100:.3f}% of the default job's step.\n\n"
        f"One process, {args.threads} torch thread(s), default job: GPT {m.n_layer} layers, d_model {m.d_model}, "
        f"seq_len {m.seq_len}; global batch {d.global_batch_size}, micro-batch {d.micro_batch_size}; "
        f"{len(times['direct'])} timed steps per variant in {args.rounds} interleaved rounds; "
        f"torch {torch.__version__}, disttrain {__version__}, Python {platform.python_version()}. "
        f"The {args.sleep_ms:g} ms/item rows use GPT {slow_cfg.model.n_layer} layer(s), "
        f"d_model {slow_cfg.model.d_model} (`--slow-model`), "
        f"whose step costs about as much as its data.\n")
    (out / "data_loader.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
