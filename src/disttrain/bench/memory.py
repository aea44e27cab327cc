"""Benchmark: the memory estimator against measurement, for every strategy at world sizes 1 and N.

    disttrain bench memory [--nproc 2] [--n-layer 4] [--d-model 128] [--micro 8] [--precision fp32]
                           [--layouts tp2,tp2+sp,pp2-1f1b,pp2-gpipe] [--world-sizes 1,2] [--out bench_results]

Each world size is one torchrun launch in which every strategy (with and without activation checkpointing)
builds the reference GPT, runs one step, and measures the bytes its rank holds (memory.measure). Where
DeepSpeed is installed, its ZeRO stages 0-3 run too (`deepspeed-zN`), with a ZeRO-3 persistence threshold
of d_model^2 elements so that both whole and partitioned parameters occur. The report puts estimate and
measurement side by side, with the per-rank model-state bytes of fsdp vs ddp and the optimizer-state bytes
of zero1 vs ddp. Results: `<out>/memory.json` and `<out>/memory.md`.

In the same launch, at world size N, the `--layouts` that fit N ranks (tensor parallelism with and without
sequence parallelism, a 2-stage pipeline under 1F1B and GPipe, the data axis taking the ranks left; and, on request,
the embeddings and first block frozen, `frozen*`) run a step of `MICRO_BATCHES` micro-batches: a pipeline's
activations are the peak it keeps in flight during its schedule (memory.SavedPeak), estimated per rank from its
stage. DeepSpeed's rows run last: ZeRO-3 replaces torch.nn.functional.linear for the rest of the process.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

from disttrain.errors import ArgumentParser, ConfigError, make_folder

PARALLEL_DEGREES = ("parallel.pipeline", "parallel.tensor", "parallel.context")
KINDS = ("params", "grads", "optimizer", "activations")
FROZEN = "tok_emb.*,pos_emb.*,blocks.0.*"
"""model.freeze of the `frozen` rows: the embeddings and the first block (a 2-stage pipeline's first stage)."""
LAYOUTS = {
    "tp2": ("parallel.tensor=2",),
    "tp2+sp": ("parallel.tensor=2", "parallel.sequence_parallel=true"),
    "pp2-1f1b": ("parallel.pipeline=2", "parallel.pipeline_schedule=1f1b"),
    "pp2-gpipe": ("parallel.pipeline=2", "parallel.pipeline_schedule=gpipe"),
    "pp2-fsdp": ("parallel.pipeline=2", "parallel.strategy=fsdp"),
    "pp2-interleaved": ("parallel.pipeline=2", "parallel.pipeline_schedule=interleaved-1f1b"),
    "pp2-zero-bubble": ("parallel.pipeline=2", "parallel.pipeline_schedule=zero-bubble"),
    "pp2-zbv": ("parallel.pipeline=2", "parallel.pipeline_schedule=zbv"),
    "pp2-dualpipev": ("parallel.pipeline=2", "parallel.pipeline_schedule=dualpipev"),
    "cp2": ("parallel.context=2",),
    "cp2-fsdp": ("parallel.context=2", "parallel.strategy=fsdp"),
    "tp2-cp2": ("parallel.tensor=2", "parallel.context=2"),
    "pp2-cp2": ("parallel.pipeline=2", "parallel.context=2"),
    "frozen": (f"model.freeze={FROZEN}",),
    "frozen-fsdp": (f"model.freeze={FROZEN}", "parallel.strategy=fsdp"),
    "pp2-frozen": ("parallel.pipeline=2", f"model.freeze={FROZEN}"),
}
"""Layouts of the model over the ranks (parallel.pipeline / parallel.tensor / parallel.context), the data axis taking
the rest (ddp unless the layout names a strategy; with 2 ranks per data coordinate pp2-fsdp is pp2-1f1b). Measured
by default: `DEFAULT_LAYOUTS`."""
DEFAULT_LAYOUTS = ("tp2", "tp2+sp", "pp2-1f1b", "pp2-gpipe", "cp2")
MICRO_BATCHES = 4
"""Micro-batches of a layout row's step (a pipeline schedule keeps some of them in flight)."""


def _args(argv):
    p = ArgumentParser(prog="disttrain bench memory", description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16-mixed", "bf16-true"),
                   help="fp16-mixed estimates like bf16-mixed; its first steps overflow and keep no optimizer state")
    p.add_argument("--strategies", default="all",
                   help="comma-separated, all (every registered strategy that is installed), or none (--layouts "
                        "only); each runs the option sets its spec lists (deepspeed: ZeRO stages 0-3, and 1-3 with "
                        "offload)")
    p.add_argument("--layouts", default=",".join(DEFAULT_LAYOUTS),
                   help="comma-separated layouts measured at world size --nproc where they fit: model-parallel "
                        "ones, and frozen parameters (frozen*: model.freeze of FROZEN) "
                        f"({', '.join(LAYOUTS)}), each over {MICRO_BATCHES} micro-batches; empty: none")
    p.add_argument("--world-sizes", default="",
                   help="comma-separated world sizes to launch (default: 1 and --nproc)")
    p.add_argument("--out", default="bench_results")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _config(args, strategy: str, checkpointing: bool, extra: tuple[str, ...] = ()):
    from disttrain.config import load_config

    return load_config(None, [f"model.n_layer={args.n_layer}", f"model.d_model={args.d_model}",
                              f"data.micro_batch_size={args.micro}", f"parallel.strategy={strategy}",
                              f"parallel.activation_checkpointing={str(checkpointing).lower()}",
                              f"parallel.precision={args.precision}", "dist.threads_per_rank=1", *extra])


def _variants(args, world: int) -> list[tuple[str, str, bool, tuple[str, ...], int]]:
    """(label, strategy, activation checkpointing, config overrides, micro-batches) for each run at `world` ranks,
    from the strategy registry: every spec's option sets (its defaults when it lists none), with and without
    activation checkpointing where the option sets are the defaults, one micro-batch each; then the `--layouts`
    that fit `world` (> 1) ranks, with ddp on the data axis, `MICRO_BATCHES` micro-batches each; DeepSpeed's last."""
    from disttrain.config import strategies_for
    from disttrain.parallel import registry

    chosen = set(registry.names() if args.strategies == "all" else args.strategies.split(","))
    ds_json = Path(args.out) / "memory_deepspeed.json"
    tmp = ds_json.with_suffix(f".{os.getpid()}.tmp")  # every rank writes the same file: atomically
    tmp.write_text(json.dumps({"zero_optimization": {"stage3_param_persistence_threshold": args.d_model ** 2}}))
    os.replace(tmp, ds_json)
    one_micro_batch = f"data.global_batch_size={args.micro * world}"  # per step, as the strategy rows measure
    runnable = set(strategies_for(_config(args, "auto", False, (one_micro_batch,)), world))  # installed, valid here
    out, last = [], []  # last: DeepSpeed's rows (ZeRO-3 replaces torch.nn.functional.linear for the rest of the
    # process, which then keeps a frozen layer's input too), after every torch-native row and layout
    for spec in map(registry.get, registry.names()):
        rows = last if spec.package == "deepspeed" else out
        if spec.name not in chosen or spec.name not in runnable:
            continue  # e.g. a precision the strategy refuses
        extra = (one_micro_batch,)
        if "deepspeed_config" in spec.options:  # partitioned and whole (persistent) ZeRO-3 parameters both occur
            extra += (f"parallel.deepspeed_config={ds_json}",)
        if "hsdp_shard_size" in spec.options:  # shard groups of 1 rank, replicated across them: not fsdp's layout
            extra += ("parallel.hsdp_shard_size=1",)
        if spec.variants:
            rows += [(label, spec.name, False, (*overrides, *extra), 1) for label, overrides in spec.variants]
        else:
            rows += [(spec.name, spec.name, ac, extra, 1) for ac in (False, True)]
    for label in filter(None, args.layouts.split(",")):
        settings = dict(o.split("=") for o in LAYOUTS[label])
        strategy = settings.pop("parallel.strategy", "ddp")
        split = math.prod(int(settings[key]) for key in PARALLEL_DEGREES if key in settings)
        if world > 1 and world % split == 0:
            batch = f"data.global_batch_size={args.micro * world // split * MICRO_BATCHES}"
            out.append((label, strategy, False,
                        (*(f"{k}={v}" for k, v in settings.items()), batch), MICRO_BATCHES))
    return out + last


def _worker(args) -> None:
    import torch

    from disttrain.backend import create_backend
    from disttrain.data import build_datasets, fetch
    from disttrain.memory import estimate, measure
    from disttrain.models import build_model
    from disttrain.optim import optimizer_factory
    from disttrain.parallel.mesh import layout_for
    from disttrain.runtime import exit_process, init_runtime, shutdown

    runtime = init_runtime(_config(args, "auto", False).dist, always_form_group=True)
    world = runtime.world_size
    rows = []
    for label, strategy, checkpointing, extra, steps in _variants(args, world):
        cfg = _config(args, strategy, checkpointing, extra)
        torch.manual_seed(0)
        train, _ = build_datasets(cfg.data, cfg.model.seq_len)
        start = layout_for(cfg.parallel, world).data_rank(runtime.rank) * args.micro * steps
        batches = [fetch(train, range(start + i * args.micro, start + (i + 1) * args.micro)) for i in range(steps)]
        measured = measure(lambda cfg=cfg: create_backend(build_model(cfg.model), optimizer_factory(cfg.optim),
                                                          cfg.parallel, runtime=runtime), batches)
        est = estimate(cfg, world, strategy, runtime.rank)
        rows.append({"strategy": label, "ac": checkpointing, "world": world, "rank": runtime.rank, "steps": steps,
                     "layout": est.layout,
                     "measured": measured,
                     "estimated": {"params": est.params, "grads": est.grads, "optimizer": est.optimizer,
                                   "activations": est.activations_ac if checkpointing else est.activations}})
    out = Path(args.out)
    (out / f"memory_w{world}_rank{runtime.rank}.json").write_text(json.dumps(rows))
    shutdown(runtime)
    exit_process(0)


def _check(args) -> list[int]:
    """The world sizes to launch, after checking every flag (one line, exit 2, before anything starts)."""
    from disttrain.bench import check_numbers, integers, rank_limit
    from disttrain.config import validate_model
    from disttrain.parallel import registry

    check_numbers(("--nproc", args.nproc, 1), ("--n-layer", args.n_layer, 1), ("--d-model", args.d_model, 1),
                  ("--micro", args.micro, 1))
    limit, what = rank_limit(0)
    if args.nproc > limit:
        raise ConfigError(f"--nproc {args.nproc}: more ranks than this machine can start ({what}); use at most {limit}")
    worlds = integers(args.world_sizes, "--world-sizes", f"world sizes 1..{limit} ({what})", "1,2",
                      high=limit) if args.world_sizes else sorted({1, args.nproc})
    validate_model(_config(args, "auto", False))  # (--d-model against the heads, before a worker finds out)
    names = [n for n in args.strategies.split(",") if n]
    unknown = [n for n in names if args.strategies not in ("all", "none") and n not in registry.names()]
    if unknown or not names:
        raise ConfigError(f"--strategies {args.strategies!r}: " + (f"{', '.join(unknown)} not known" if unknown else
                          "names none") + f"; choose from {', '.join(registry.names())}, all, or none (layouts only)")
    bad = [label for label in args.layouts.split(",") if label and label not in LAYOUTS]
    if bad:
        raise ConfigError(f"--layouts {', '.join(bad)}: not known; choose from {', '.join(LAYOUTS)}, or leave it "
                          "empty for none")
    return worlds


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    if args.worker:
        _worker(args)
        return 0
    from disttrain.bench import worker_entry
    from disttrain.launch import launch

    worlds = _check(args)
    out = make_folder(Path(args.out).resolve(), "--out")
    for world in worlds:
        code = launch(world, worker_entry("disttrain.bench.memory", args), out / "memory_run")
        if code:
            return code
    rows = [row for path in sorted(out.glob("memory_w*_rank*.json")) for row in json.loads(path.read_text())]
    report = _report(rows, args)
    (out / "memory.json").write_text(json.dumps({"rows": rows, **report["figures"]}, indent=1))
    (out / "memory.md").write_text(report["markdown"])
    print(report["markdown"])
    return 0


def _report(rows: list[dict], args) -> dict:
    lines = ["| world | strategy | AC | rank | " + " | ".join(f"{k} est/meas MiB (err)" for k in KINDS) + " |",
             "|---|---|---|---|" + "---|" * len(KINDS)]
    worst = 0.0
    for r in rows:
        cells = []
        for k in KINDS:
            est, meas = r["estimated"][k], r["measured"][k]
            err = abs(est - meas) / meas if meas else float(est != 0)  # nothing measured: 0% or 100% off
            worst = max(worst, err)
            cells.append(f"{est / 2**20:.2f}/{meas / 2**20:.2f} ({err:.1%})")
        label = f"{r['strategy']} ({r['layout']})" if r.get("layout") else r["strategy"]
        lines.append(f"| {r['world']} | {label} | {'yes' if r['ac'] else 'no'} | {r['rank']} | "
                     + " | ".join(cells) + " |")

    def ratio(strategy, key):  # of the most loaded ranks, vs ddp (None where either was not run)
        held = {s: [sum(r["measured"][k] for k in key) for r in rows
                    if r["strategy"] == s and r["world"] == args.nproc and not r["ac"]] for s in (strategy, "ddp")}
        return max(held[strategy]) / max(held["ddp"]) if all(held.values()) else None

    figures = {"worst_relative_error": worst,
               "fsdp_over_ddp_model_state_bytes": ratio("fsdp", ("params", "grads", "optimizer")),
               "zero1_over_ddp_optimizer_bytes": ratio("zero1", ("optimizer",))}
    markdown = (f"# Memory: estimate vs measurement (GPT {args.n_layer} layers x d_model {args.d_model}, "
                f"micro-batch {args.micro}, {args.precision}, AdamW)\n\n" + "\n".join(lines) + "\n\n"
                f"- worst relative error of the estimate: **{worst:.2%}** (target <= 10%)\n")
    for key, what, against in (("fsdp_over_ddp_model_state_bytes", "model-state", "fsdp"),
                               ("zero1_over_ddp_optimizer_bytes", "optimizer-state", "zero1")):
        if figures[key] is not None:
            markdown += (f"- per-rank {what} bytes, {against} / ddp at world size {args.nproc}: "
                         f"**{figures[key]:.3f}** (target <= 0.52)\n")
    return {"figures": figures, "markdown": markdown}


if __name__ == "__main__":
    main()
