"""Benchmark: a tensor-parallel step with the loss on logits split by vocabulary (loss parallel) vs gathered logits.

    disttrain bench loss-parallel [--nproc 2] [--vocabs 256,8192,32768] [--micro 8] [--steps 10] [--out DIR]

One launch of --nproc ranks (parallel.tensor = --nproc, one thread each), the reference GPT (2 layers, d_model 128,
seq_len 64) at each vocabulary size, built twice: `parallel.loss_parallel = false` (the head's logits gathered on
every rank, then the loss) and `true` (torch's `loss_parallel`: each rank's share of the vocabulary, two all-reduces
of one value per token). Each row is the median time of --steps steps (forward, backward, optimizer) after two
warm-up steps, on rank 0; the two builds alternate per vocabulary. The crossover is what `parallel.loss_parallel =
auto` (parallel/tensor.py: SPLIT_LOGITS_FROM) rests on. Output: `<out>/loss_parallel.{json,md}`.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from disttrain.errors import ArgumentParser, ConfigError, make_folder


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(prog="disttrain bench loss-parallel", description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="ranks = tensor-parallel degree")
    p.add_argument("--vocabs", default="256,8192,32768", help="vocabulary sizes, comma-separated")
    p.add_argument("--micro", type=int, default=8, help="sequences per step")
    p.add_argument("--steps", type=int, default=10, help="timed steps per row")
    p.add_argument("--out", default="bench_results")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _check(args: argparse.Namespace) -> list[int]:
    """The vocabularies to time, after checking every flag (one line, exit 2, before any launch)."""
    from disttrain.bench import check_numbers, integers, rank_limit

    check_numbers(("--nproc", args.nproc, 1), ("--micro", args.micro, 1), ("--steps", args.steps, 1))
    limit, what = rank_limit(0)
    if args.nproc > limit:
        raise ConfigError(f"--nproc {args.nproc}: more ranks than this machine can start ({what}); use at most {limit}")
    what, example = f"sizes >= 256 divisible by --nproc {args.nproc}", "256,8192,32768"
    vocabs = integers(args.vocabs, "--vocabs", what, example, low=256)
    if any(v % args.nproc for v in vocabs):
        raise ConfigError(f"--vocabs {args.vocabs!r}: give {what}, e.g. --vocabs {example}")
    return vocabs


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    if args.worker:
        _worker(args)
        return 0
    from disttrain.bench import launch_workers

    _check(args)
    code, out = launch_workers(args, "loss_parallel")
    if code == 0:
        print((out / "loss_parallel.md").read_text())
    return code


def _step_ms(args, runtime, vocab: int, split: str) -> float:
    import torch

    from disttrain.backend import create_backend
    from disttrain.config import load_config
    from disttrain.models import build_model
    from disttrain.optim import optimizer_factory

    cfg = load_config(None, [f"parallel.tensor={args.nproc}", f"parallel.loss_parallel={split}", "model.n_layer=2",
                             "model.d_model=128", "model.seq_len=64", f"model.vocab_size={vocab}"])
    torch.manual_seed(0)
    backend = create_backend(build_model(cfg.model), optimizer_factory(cfg.optim), cfg.parallel, runtime=runtime)
    ids = torch.randint(0, vocab, (args.micro, cfg.model.seq_len))
    batch = {"input_ids": ids, "labels": ids}
    times = []
    for _ in range(args.steps + 2):
        start = time.perf_counter()
        backend.forward_backward(batch)
        backend.optim_step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:]) * 1000


def _worker(args: argparse.Namespace) -> None:
    import torch

    from disttrain.config import load_config
    from disttrain.runtime import exit_process, init_runtime, shutdown

    runtime = init_runtime(load_config(None, ["dist.threads_per_rank=1"]).dist, always_form_group=True)
    rows = []
    for vocab in _check(args):
        gathered, split = _step_ms(args, runtime, vocab, "false"), _step_ms(args, runtime, vocab, "true")
        rows.append({"vocab": vocab, "gathered_ms": gathered, "split_ms": split, "ratio": split / gathered})
    if runtime.rank == 0:
        out = make_folder(Path(args.out), "--out")
        meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "nproc": args.nproc, "micro": args.micro,
                "steps": args.steps, "torch": torch.__version__, "python": platform.python_version()}
        (out / "loss_parallel.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
        lines = [f"# Loss parallel vs gathered logits, tp{args.nproc} ({meta['date']})", "",
                 "| vocabulary | gathered (ms/step) | split, loss parallel (ms/step) | split / gathered |",
                 "|---|---|---|---|"]
        lines += [f"| {r['vocab']} | {r['gathered_ms']:.1f} | {r['split_ms']:.1f} | **{r['ratio']:.3f}** |"
                  for r in rows]
        lines += ["", f"GPT 2 layers, d_model 128, seq_len 64, {args.micro} sequences per step, {args.nproc} ranks x 1 "
                  f"thread, gloo; median of {args.steps} steps after 2 warm-up; torch {meta['torch']}, Python "
                  f"{meta['python']}.", ""]
        (out / "loss_parallel.md").write_text("\n".join(lines))
    shutdown(runtime)
    exit_process(0)


if __name__ == "__main__":
    main()
