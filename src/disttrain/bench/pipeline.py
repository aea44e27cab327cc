"""Benchmark: the pipeline bubble of disttrain's pipeline step, measured against the schedule's theory and against
the schedule played through (the scale model's `pipeline_timeline`).

    disttrain bench pipeline [--nproc 2] [--schedules gpipe,1f1b,...] [--microbatches 2,4,8] [--micro 16] [--steps 8]

One launch; the model (2 blocks a rank, at least 4) is split over --nproc ranks (parallel.pipeline = --nproc, no
data axis), one stage a rank or, under interleaved-1f1b, zero-bubble, zbv and dualpipev, two. For each schedule and
number of micro-batches m (the global batch is m x --micro, so a micro-batch costs the same for every m), every
timed step gives:

- W, the schedule's wall time in disttrain's step (the step's last `forward_backward`, which runs the schedule over
  the step's m micro-batches; the optimizer step aside) until its slowest rank ends;
- T per rank, its stages' forward and backward of one micro-batch run alone right after the step, outside the
  schedule (the last stage with the loss), so that W and T see the same machine (forward and backward timed apart).

A rank computes m x T in a step of W, so its idle share is 1 - m T / W (medians of W and T over the steps); the
measured bubble is that share averaged over the ranks (`bubble_per_stage`: per rank). Three predictions: the
formula GPipe and 1F1B share, (p - 1) / (m + p - 1) for p equal stages whose sends cost nothing; and the schedule
played (`pipeline_timeline.play` in torch's own order of computations, each stage's forward and backward as measured
alone), for every schedule, the stages' imbalance included, with sends free and with each transfer a call on its
rank's core as measured alone (one micro-batch's activations to the next rank; charged once a computation that
crosses ranks, as the scale model prices a CPU host's: exact at 2 ranks, an undercount for a middle rank at 3 or
more). The measured bubble also holds the schedule's own work. Output: `<out>/pipeline.{json,csv,md}` and, with
matplotlib, `<out>/bubble.png`.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from disttrain.bench import check_numbers, integers
from disttrain.errors import ArgumentParser, ConfigError, make_folder
from disttrain.parallel.mesh import SPLIT_BACKWARD_SCHEDULES

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv", "dualpipev")
"""Schedules measured: the first two with one stage per rank, whose bubble is (p - 1) / (m + p - 1), the others with
two (dualpipev's overlapped forward-backward pairs played as torch runs them, one after the other)."""


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(prog="disttrain bench pipeline", description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="ranks (one stage each, two under the looped and V schedules)")
    p.add_argument("--schedules", default="gpipe,1f1b", help="comma-separated: " + ", ".join(SCHEDULES))
    p.add_argument("--microbatches", default="2,4,8", help="micro-batches per step, comma-separated")
    p.add_argument("--micro", type=int, default=16, help="micro-batch size (sequences)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per row (and repeats of the stage alone)")
    p.add_argument("--out", default="bench_results")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def plan(args: argparse.Namespace) -> list[tuple[str, int]]:
    """The rows (schedule, micro-batches), every one checked before any process starts (one line, exit 2)."""
    from disttrain.config import validate
    from disttrain.parallel.mesh import VIRTUAL_SCHEDULES
    from disttrain.parallel.placement import torch_order

    schedules = [s for s in args.schedules.split(",") if s]
    for s in schedules:
        if s not in SCHEDULES:
            raise ConfigError(f"--schedules {s}: use {', '.join(SCHEDULES)}")
    if not schedules:
        raise ConfigError("--schedules names none: give one or more, e.g. gpipe,1f1b")
    check_numbers(("--nproc", args.nproc, 2), ("--micro", args.micro, 1), ("--steps", args.steps, 1))
    counts = integers(args.microbatches, "--microbatches", f"counts >= the {args.nproc} stages", "2,4,8")
    for m in counts:
        if m < args.nproc:
            raise ConfigError(f"--microbatches {m}: fewer micro-batches than the {args.nproc} stages (1F1B needs at "
                              f"least one per stage); use values >= {args.nproc}")
    rows = [(s, m) for s in schedules for m in counts]
    for s, m in rows:
        validate(_config(args, s, m), 0, args.nproc)
        if s in VIRTUAL_SCHEDULES and any(torch_order(s, args.nproc, r, m) is None for r in range(args.nproc)):
            raise ConfigError(f"--schedules {s}: this torch does not give the schedule's order of computations, "
                              "which the report plays; measure gpipe or 1f1b")
    return rows


def theoretical(stages: int, microbatches: int) -> float:
    """GPipe's and 1F1B's bubble: the share of a step a stage is idle, for equal stages and free sends."""
    return (stages - 1) / (microbatches + stages - 1)


def played(schedule: str, ranks: int, microbatches: int, costs: list[list[tuple[float, ...]]],
           transfer: float = 0.0) -> float:
    """The bubble of `schedule` played through (`pipeline_timeline.play`, torch's own order), each stage's forward
    and backward as `costs[rank][local stage]` says ((forward, backward), and the split backward's input and weight
    parts where measured: else half the backward each), each transfer a call of `transfer` seconds on its rank's
    core (as the scale model prices a CPU host's; 0: free): 1 - m T / W averaged over the ranks."""
    from disttrain.bench.pipeline_timeline import StageCost, one_stage_order, play
    from disttrain.parallel.mesh import VIRTUAL_SCHEDULES, holder, stages_of
    from disttrain.parallel.placement import torch_order

    v = len(costs[0])
    stages = [StageCost(0.0, 0.0)] * (ranks * v)
    for rank in range(ranks):
        for local, stage in enumerate(stages_of(rank, ranks, ranks * v, schedule)):
            forward, backward, *split = costs[rank][local]  # (a split backward's parts, where measured apart)
            if stage == 0 and schedule in SPLIT_BACKWARD_SCHEDULES:  # (as torch runs it: the whole backward as W)
                split = (0.0, backward)
            stages[stage] = StageCost(forward, backward, split=tuple(split))
    orders = tuple(tuple(torch_order(schedule, ranks, r, microbatches, v) if schedule in VIRTUAL_SCHEDULES
                         else one_stage_order(schedule, ranks, r, microbatches)) for r in range(ranks))
    wall = max(play(orders, lambda s: holder(s, ranks, schedule), tuple(stages), transfer, on_host=True))
    return statistics.fmean(1 - microbatches * sum(c[0] + c[1] for c in mine) / wall for mine in costs)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    if args.worker:
        _worker(args)
        return 0
    from disttrain.bench import launch_workers

    plan(args)
    code, out = launch_workers(args, "pipeline")
    if code == 0:
        print((out / "pipeline.md").read_text())
    return code


def _config(args: argparse.Namespace, schedule: str, microbatches: int):
    from disttrain.config import load_config

    return load_config(None, [f"data.global_batch_size={microbatches * args.micro}",
                              f"model.n_layer={max(4, 2 * args.nproc)}",
                              f"data.micro_batch_size={args.micro}", "dist.threads_per_rank=1", "log.progress=false",
                              "train.steps=100000", f"dist.nproc={args.nproc}", f"run.out_dir={args.out}",
                              "run.name=pipeline_run", "parallel.strategy=ddp", f"parallel.pipeline={args.nproc}",
                              f"parallel.pipeline_schedule={schedule}"])


def _measure(args, cfg, runtime, train, sampler) -> torch.Tensor:
    """(2 + 4 v, steps) on this rank of v stages: per timed step, its schedule's wall time in disttrain's step, then
    each of its stages' forward, backward and, under a schedule that splits it, the backward's input and weight
    parts (else 0) of one micro-batch alone (right after, so that both see the same machine), then one transfer of
    a micro-batch's activations to the next rank."""
    import torch.distributed as dist

    from disttrain.bench.loops import disttrain_setup

    _, backend, _, batches, micro = disttrain_setup(cfg, runtime, train, sampler)
    times = torch.zeros(2 + 4 * len(backend.prepared.parts), args.steps + 2, dtype=torch.float64)  # 2 warm-up steps
    split = cfg.parallel.pipeline_schedule in SPLIT_BACKWARD_SCHEDULES
    for k in range(args.steps + 2):
        dist.barrier()
        for i in range(micro):
            batch = next(batches)
            start = time.perf_counter()
            backend.forward_backward(batch, sync=i == micro - 1)  # the last one runs the schedule
        times[0, k] = time.perf_counter() - start
        backend.optim_step()
        dist.barrier()
        for j, (index, part) in enumerate(backend.prepared.parts):
            alone = _stage_alone(backend.prepared.layout, index, part, batch)
            # (the first stage's input, token ids, has no gradient: torch skips its input part and runs the whole
            # backward as its weight part, which `played` takes so)
            parts = _stage_alone(backend.prepared.layout, index, part, batch, split=True)[1:] if split and index \
                else (0, 0)
            times[1 + 4 * j:5 + 4 * j, k] = torch.tensor((*alone, *parts), dtype=torch.float64)
        times[-1, k] = _transfer(backend.prepared.layout, batch)
    return times[:, 2:]


def _transfer(lay, batch: dict) -> float:
    """Seconds of one micro-batch's activations sent to the next rank while the one before's arrive (every rank at
    once, as a schedule's steady state sends)."""
    import torch.distributed as dist

    ids = batch["input_ids"]
    sent = torch.randn((*ids.shape, lay.hidden), dtype=lay.dtype)
    received = torch.empty_like(sent)
    dist.barrier(group=lay.group)
    start = time.perf_counter()
    for request in dist.batch_isend_irecv([
            dist.P2POp(dist.isend, sent, group=lay.group, group_peer=(lay.rank + 1) % lay.ranks),
            dist.P2POp(dist.irecv, received, group=lay.group, group_peer=(lay.rank - 1) % lay.ranks)]):
        request.wait()
    return time.perf_counter() - start


def _stage_alone(lay, index: int, part, batch: dict, split: bool = False) -> tuple[float, ...]:
    """(forward, backward) seconds of one of this rank's stages on one micro-batch outside the schedule: token ids
    into the first stage, a random stream into the others; the last stage ends in the token-sum loss. `split`:
    (forward, the backward's input part, its weight part), as torch's split-backward schedules run them
    (`stage_backward_input`, `stage_backward_weight`). Gradients are dropped after."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    ids, labels = batch["input_ids"], batch["labels"]
    x = ids if index == 0 else torch.randn((*ids.shape, lay.hidden), dtype=lay.dtype, requires_grad=True)
    grad = None if index == lay.stages - 1 else torch.randn((*ids.shape, lay.hidden), dtype=lay.dtype)
    start = time.perf_counter()
    out = part(x)
    if grad is None:
        out = F.cross_entropy(out.flatten(0, 1), labels.flatten(), reduction="sum")
    forward = time.perf_counter()
    if split:
        _, groups = stage_backward_input([out], None if grad is None else [grad], [x], part.parameters())
        inputs = time.perf_counter()
        stage_backward_weight(part.parameters(), groups)
        times = (forward - start, inputs - forward, time.perf_counter() - inputs)
    else:
        out.backward(grad)
        times = (forward - start, time.perf_counter() - forward)
    part.zero_grad(set_to_none=True)
    return times


def _worker(args: argparse.Namespace) -> None:
    import gc

    import torch.distributed as dist

    from disttrain.bench.overhead import start_worker
    from disttrain.runtime import exit_process, shutdown

    rows = plan(args)
    runtime, train, sampler = start_worker(_config(args, *rows[0]))
    measured = []
    for schedule, m in rows:
        mine = _measure(args, _config(args, schedule, m), runtime, train, sampler)
        every = [torch.empty_like(mine) for _ in range(runtime.world_size)]
        dist.all_gather(every, mine)
        measured.append((schedule, m, torch.stack(every)))  # (rank, wall / its stages' (F, B) / transfer, step)
        gc.collect()
    if runtime.is_main_process():
        _report(args, _config(args, *rows[0]), measured)
    shutdown(runtime)
    exit_process(0)


def _report(args, cfg, measured: list) -> None:
    from disttrain._version import __version__

    p = args.nproc
    rows = []
    for schedule, m, times in measured:
        wall = float(times[:, 0].max(dim=0).values.median())  # a step's schedule lasts until its slowest rank ends
        parts = times[:, 1:-1].median(dim=2).values  # (rank, F / B / I / W of each of its stages)
        transfer = float(times[:, -1].median())
        costs = [[tuple(float(t) for t in r[4 * j:4 * j + (4 if r[4 * j + 2] else 2)]) for j in range(len(r) // 4)]
                 for r in parts]  # ((F, B), and the split backward's (I, W) where measured: (F, B, I, W))
        alone = [sum(c[0] + c[1] for c in mine) for mine in costs]
        idle = [1 - m * a / wall for a in alone]
        rows.append({"schedule": schedule, "stages": p, "microbatches": m, "micro_batch": args.micro,
                     "schedule_s": wall, "schedule_s_per_stage": [float(t) for t in times[:, 0].median(dim=1).values],
                     "stage_micro_s": alone, "stage_costs_s": costs, "bubble_per_stage": idle,
                     "bubble": statistics.fmean(idle), "theoretical": theoretical(p, m),
                     "played": played(schedule, p, m, costs), "transfer_s": transfer,
                     "played_with_transfers": played(schedule, p, m, costs, transfer)})
    result = {"rows": rows, "nproc": p, "steps": args.steps, "model": vars(cfg.model), "threads_per_rank": 1,
              "torch": torch.__version__, "disttrain": __version__, "python": platform.python_version(),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    out = make_folder(Path(args.out), "--out")
    (out / "pipeline.json").write_text(json.dumps(result, indent=2))
    with open(out / "pipeline.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["schedule", "stages", "microbatches", "micro_batch", "schedule_s", "stage_micro_s_max",
                         "bubble", "theoretical", "played", "transfer_s", "played_with_transfers"])
        for r in rows:
            writer.writerow([r["schedule"], p, r["microbatches"], args.micro, r["schedule_s"],
                             max(r["stage_micro_s"]), r["bubble"], r["theoretical"], r["played"], r["transfer_s"],
                             r["played_with_transfers"]])
    (out / "pipeline.md").write_text(_markdown(args, cfg, result) + _plot(rows, out))


def _markdown(args, cfg, result: dict) -> str:
    m = cfg.model
    lines = [f"# Pipeline bubble: measured vs (p - 1) / (m + p - 1) and vs the schedule played ({result['date']})", "",
             "| schedule | ranks p | micro-batches m | schedule wall W (ms) | one micro-batch alone T "
             "(ms, per rank) | idle 1 - mT/W (per rank) | **measured** | theoretical | played | transfer (ms) | "
             "played, transfers as calls |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        per = lambda values, scale=1e3, f=".1f": " / ".join(f"{v * scale:{f}}" for v in values)  # noqa: E731
        lines.append(f"| {r['schedule']} | {r['stages']} | {r['microbatches']} | {r['schedule_s'] * 1e3:.1f} | "
                     f"{per(r['stage_micro_s'])} | {per(r['bubble_per_stage'], 1, '.3f')} | **{r['bubble']:.3f}** | "
                     f"{r['theoretical']:.3f} | {r['played']:.3f} | {r['transfer_s'] * 1e3:.2f} | "
                     f"{r['played_with_transfers']:.3f} |")
    return "\n".join(lines) + (
        "\n\nW: the step's schedule (all m micro-batches, forward and backward) in disttrain's step, until its slowest "
        "rank ends, median of the timed steps; T: a rank's stages' forward and backward of one micro-batch run alone "
        "right after each step, median; the measured bubble is 1 - mT/W averaged over the ranks. The theory "
        "((p - 1) / (m + p - 1): gpipe's and 1f1b's) assumes equal stages and free sends; the schedule played "
        "(`pipeline_timeline.play`, torch's own order) takes each stage's forward and backward as measured alone, "
        "sends free, and again with each transfer a call on its rank's core (as the scale model prices a CPU host's: "
        "one micro-batch's activations to the next rank, timed alone after each step, median); the measurement also "
        "holds the schedule's own work.\n\n"
        f"{args.nproc} ranks x 1 thread, gloo; GPT {m.n_layer} layers, d_model {m.d_model}, seq_len {m.seq_len}, "
        f"vocab {m.vocab_size}; micro-batch {args.micro} sequences; {args.steps} timed steps per row; machine "
        f"{result['machine']}; torch {result['torch']}, disttrain {result['disttrain']}, Python {result['python']}.\n")


def _plot(rows: list[dict], out: Path) -> str:
    """bubble.png: measured and theoretical bubble against m, one line per schedule; the line the report adds."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return "\nPNG not written: matplotlib is not installed; pip install 'disttrain[plot]'\n"
    fig = Figure(figsize=(6.4, 4.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    counts = sorted({r["microbatches"] for r in rows})
    ax.plot(counts, [theoretical(rows[0]["stages"], m) for m in counts], "k--", label="(p-1)/(m+p-1)")
    for schedule in dict.fromkeys(r["schedule"] for r in rows):
        points = [r for r in rows if r["schedule"] == schedule]
        line, = ax.plot([r["microbatches"] for r in points], [r["bubble"] for r in points], "o-",
                        label=f"{schedule} measured")
        ax.plot([r["microbatches"] for r in points], [r["played"] for r in points], "x:", color=line.get_color(),
                label=f"{schedule} played")
    ax.set_xlabel("micro-batches per step (m)")
    ax.set_ylabel("bubble fraction")
    ax.set_xscale("log", base=2)
    ax.set_xticks(counts, [str(m) for m in counts])
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.savefig(out / "bubble.png", dpi=120, bbox_inches="tight")
    return "\n![bubble](bubble.png)\n"


if __name__ == "__main__":
    main()
