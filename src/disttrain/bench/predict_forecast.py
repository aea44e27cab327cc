"""`disttrain bench predict`'s forecast (predict.py runs it): the job's batch per GPU and compute, each swept value's
workload, the scale model's steps at each GPU count, and the report's header and table."""

from __future__ import annotations

import argparse
import os
import platform
import time

from disttrain.bench.model_shapes import ModelShape
from disttrain.bench.predict_job import (
    config_batch,
    config_strategy,
    context_calls_of,
    pipeline_orders,
    pipeline_stages,
    settings,
    split_group,
    stage_calls_of,
    tensor_calls_of,
)
from disttrain.bench.scale_model import (
    BYTES,
    H100_BF16_TFLOPS,
    H100_FP32_TFLOPS,
    SPLIT_NAMES,
    Workload,
    compute_seconds,
    predict,
    reduced_bytes,
)
from disttrain.config import Config
from disttrain.errors import ConfigError

FORECAST_SWEEPS = ("parallel.grad_compression", "parallel.powersgd_rank", "parallel.bucket_cap_mb",
                   "parallel.hsdp_shard_size", "parallel.fsdp_prefetch", "train.log_every", "parallel.tensor",
                   "parallel.sequence_parallel", "parallel.pipeline", "parallel.pipeline_schedule",
                   "parallel.pipeline_stages_per_rank", "parallel.context")
"""Settings `--sweep` forecasts: those that change a step's collectives, and the model's splits, whose compute a GPU's
share of the FLOPs gives (a group's batch kept: the config's)."""

SPLITS = ("parallel.tensor", "parallel.pipeline", "parallel.context")
"""Swept settings that change a GPU's compute: forecast from FLOPs only (not a given or measured one)."""

LOCAL_BATCH = {"llama3-8b": 2, "llama3-70b": 1, "resnet50": 32, "bert-large": 32}
"""Sequences (images) per GPU per step of each preset model: torchtitan's Llama runs, the DDP paper's batch."""


def default_batch(args: argparse.Namespace, cfg: Config) -> tuple[int, int]:
    """(sequences per GPU per step, per forward pass) where no flag gives them: a preset's batch, not accumulated,
    or the config's job's (`config_batch`)."""
    return (LOCAL_BATCH[args.model],) * 2 if args.model else config_batch(cfg, args.nodes)


def _frozen(shape: ModelShape) -> str:
    frozen = 1 - shape.trained_params / shape.params
    return f", {frozen:.1%} of the parameters frozen (model.freeze: gathered, never reduced)" if frozen else ""


def cpu_cores(args: argparse.Namespace, fit: dict | None) -> int:
    if args.cpu_cores >= 0:
        return args.cpu_cores
    return len(os.sched_getaffinity(0)) if fit and fit.get("device") == "cpu" else 0


def forecast(args, strategies, gpus, shape, precision, net, fit, cfg) -> tuple[str, list[dict]]:
    jobs = sweep_jobs(args, cfg, strategies)
    picked = not strategies and not args.model
    local, micro, given = _forecast_batch(args, cfg)
    job = settings(cfg)
    tensor, pipeline, context = job["tensor"], job["pipeline"], job["context"]
    group = split_group(cfg)
    base, source = _workload(args, shape, precision, cfg, local, micro, fit, _data_axis(cfg, gpus))  # (the header's)
    rows, failed = [], {}
    for setting, swept in jobs:
        names = strategies or ["fsdp" if args.model else config_strategy(swept)]
        try:
            work, alone = _workloads(args, shape, precision, swept, (local, micro), fit, gpus,
                                     base if swept is cfg else None)
        except ConfigError as exc:  # (a value the model does not price, e.g. a tensor degree straddling nodes)
            if not setting:
                raise
            for strategy in names:
                failed.setdefault(strategy, []).append((setting, str(exc)))
            continue
        for strategy in names:
            try:
                predicted = predict(strategy, gpus, work, net, alone)
            except ConfigError as exc:
                if not setting:
                    raise
                failed.setdefault(strategy, []).append((setting, str(exc)))
                continue
            rows += [{"strategy": strategy, **({"setting": setting} if setting else {}), "gpus": p.gpus,
                      "nodes": -(-p.gpus // net.gpus_per_node), "step_s": p.step.step_s, "compute_s": p.step.compute_s,
                      "comm_s": p.step.comm_s, "exposed_s": p.step.exposed_s, "wire_bytes_per_gpu": p.step.wire_bytes,
                      "tokens_per_s_per_gpu": p.tokens_per_s_per_gpu, "efficiency": p.efficiency} for p in predicted]
    for errors in failed.values():  # the same refusal at every value is not the sweep's: as without one
        if len(errors) == len(jobs) and len({error for _, error in errors}) == 1:
            raise ConfigError(errors[0][1])
    skipped = [f"{strategy} with {setting} ({error})" for strategy, errors in failed.items()
               for setting, error in errors]
    if not rows:
        raise ConfigError(f"--sweep {args.sweep}: no strategy runs any of its values: {'; '.join(skipped)}")
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    factors = (f" (DDP's buckets as rank-{job['powersgd_rank']} factors)" if job["grad_compression"] == "powersgd"
               else "")
    lines = [f"# Predicted scaling: {shape.name}, {', '.join(strategies)} ({report_date()})", "",
             *([f"- strategy: the config's parallel.strategy = {cfg.parallel.strategy!r}, modelled as "
                f"{', '.join(strategies)}"] if picked else []),
             f"- model: {shape.params / 1e6:,.1f} M parameters, {shape.n_layer} blocks of "
             f"{shape.layer_params / 1e6:,.2f} M{_frozen(shape)}; {local} x {max(shape.seq_len, 1)} tokens per "
             f"{'group' if group > 1 else 'GPU'} per step ({given}; "
             + (f"{local // micro} micro-batches of {micro}: gradients reduced on the last)" if local > micro
                else "no accumulation)"),
             *([_split_line(cfg, base, local)] if tensor > 1 else []),
             *([_pipeline_line(cfg, base.stages, base.send_bytes, local // micro)] if pipeline > 1 else []),
             *([_context_line(base, local)] if context > 1 else []),
             f"- compute of one step on one device: {base.compute_s:.4g} s, {source}",
             f"- precision {precision}, gradient compression {job['grad_compression']}: bytes per element stored / "
             f"gathered / reduced {' / '.join(map(str, BYTES[precision][:2]))} / "
             f"{reduced_bytes(precision, job['grad_compression'])}{factors}; DDP buckets of "
             f"{job['bucket_bytes'] / 2**20:g} MiB; a logged line every {job['log_every']} steps",
             *([f"- swept: {args.sweep.partition('=')[0]} (each row's setting; the line above is the config's)"]
               if len(jobs) > 1 or jobs[0][0] else []),
             f"- interconnect {net.name}: {net.gpus_per_node} devices per node; {net.note}", "", *_table(rows)]
    if skipped:
        lines += ["", f"Not predicted: {'; '.join(skipped)}."]
    lines += ["", "Efficiency: tokens/s per GPU relative to the smallest count (weak scaling). Collectives: the sum "
              "of their times, mostly hidden behind compute; exposed: what the step waits for. " + report_footer()]
    return "\n".join(lines) + "\n", rows


def _split_line(cfg: Config, work: Workload, local: int) -> str:
    """The report's line on a tensor split: its degree, the batch its ranks share, the calls and bytes it sends (a
    pipeline's busiest stage's and rank's)."""
    t, p, c = work.tensor, work.pipeline, work.context
    calls = work.tensor_calls or max(work.stage_calls, key=len) + max(work.step_calls, key=len)
    sent = {part: sum(1 for c in calls if c[0] == part) for part in ("forward", "backward", "step")}
    size = sum(c[2] for c in calls if c[0] != "step") / 2**20
    return (f"- tensor split over {t} GPUs of a node (parallel.tensor; sequence parallel "
            f"{'on' if cfg.parallel.sequence_parallel else 'off'}): a group's ranks share its {local} sequences "
            f"(tokens per GPU: 1/{t * p * c} of them); each micro-batch sends {sent['forward']} collectives in forward "
            f"and {sent['backward']} in backward ({size:,.1f} MiB{', the busiest stage' if p > 1 else ''}), the "
            f"step {sent['step']} more, each holding up the compute; the strategy runs over GPUs / {t * p} ranks, "
            f"each with 1/{t} of its {'stage' if p > 1 else 'model'}'s parameters")


def _workloads(args, shape: ModelShape, precision: str, cfg: Config, batch: tuple[int, int], fit: dict | None,
               gpus: list[int], base: Workload | None) -> tuple[Workload, Workload | None]:
    """(the workload of `cfg` at `gpus`, `base` where given; and where the smallest count is one group of a split
    and others are more, its workload alone: no data axis beside the split, whose calls travel in the parameters'
    dtype there)."""
    group = split_group(cfg)
    work = base or _workload(args, shape, precision, cfg, *batch, fit, _data_axis(cfg, gpus))[0]
    alone = _workload(args, shape, precision, cfg, *batch, fit, False)[0] \
        if 1 < group == min(gpus) < max(gpus) and not _data_axis(cfg, [group]) else None
    return work, alone


def _data_axis(cfg: Config, gpus: list[int]) -> bool:
    """Whether the largest of `gpus` has a data axis beside the splits: more GPUs than a group, or a context split,
    whose ranks are one themselves (disttrain wraps them in the strategy: FSDP2's gathered copies, in the compute
    dtype under a mixed precision)."""
    return max(gpus) > split_group(cfg) or cfg.parallel.context > 1


def _workload(args, shape: ModelShape, precision: str, cfg: Config, local: int, micro: int, fit: dict | None,
              data_axis: bool) -> tuple[Workload, str]:
    """(one forecast's workload of `cfg`, the config or one swept value of it, where its compute comes from): a group
    of tensor x pipeline x context GPUs reading `local` sequences in micro-batches of `micro`, each GPU computing its
    share (a context split's ranks as many tokens and causal query-key pairs each: parallel/context.py balances
    them), and the splits' calls (`data_axis`: as beside data-parallel ranks, where a mixed precision's stream is
    gathered in the compute dtype; at a count of one group it is not, and the stream's calls are twice the
    bytes)."""
    job = settings(cfg)
    tokens = local * max(shape.seq_len, 1) / split_group(cfg)  # (a group's ranks share a batch)
    compute, source = _compute(args, shape, tokens, precision, fit, local, micro, job["pipeline"])
    split = pipeline_stages(cfg, shape, precision, data_axis)
    calls = stage_calls_of(cfg, shape, precision, micro, data_axis)
    return Workload(shape, compute, tokens, precision, local // micro, cpu_cores=cpu_cores(args, fit), **job,
                    tensor_calls=tensor_calls_of(cfg, shape, precision, micro, data_axis), stages=split.stages,
                    context_calls=context_calls_of(cfg, shape, precision, micro),
                    stage_calls=calls.stages, step_calls=calls.steps, orders=pipeline_orders(cfg, local // micro),
                    send_bytes=split.send_bytes * micro, tied_bytes=split.tied_bytes), source


def _context_line(work: Workload, local: int) -> str:
    """The report's line on a context split: its degree, the batch its ranks share, its calls."""
    from disttrain.bench.model_split import rank_context_calls
    from disttrain.parallel.mesh import stages_of

    c, p, calls = work.context, work.pipeline, work.context_calls
    if p > 1:  # (the busiest pipeline rank's)
        calls = max((rank_context_calls(work, stages_of(rank, p, len(work.stages), work.schedule))
                     for rank in range(p)), key=len)
    size = sum(call[2] for call in calls) / 2**20
    sent = {part: sum(1 for call in calls if call[0] == part) for part in ("forward", "backward")}
    over = (", each with the whole model" if work.tensor == 1 and p == 1 else
            f" / {work.tensor} (the tensor split's groups)" if p == 1 else " of a stage (each with its stage)")
    return (f"- context split over {c} GPUs of a node (parallel.context): a group's ranks share its {local} sequences, "
            f"each computing 2 of {2 * c} pieces of every sequence (tokens per GPU: 1/{c * work.tensor * p} of them; "
            f"as many causal query-key pairs each); each micro-batch sends {sent['forward']} collectives in forward "
            f"and {sent['backward']} in backward ({size:,.1f} MiB{', the busiest pipeline rank' if p > 1 else ''}: "
            f"each attention's keys and values, and their gradients), each holding up the compute; the strategy runs "
            f"over every GPU{over}")


def _pipeline_line(cfg: Config, stages: tuple[ModelShape, ...], send: float, micro_batches: int) -> str:
    """The report's line on a pipeline: its ranks, schedule, what each holds, the micro-batches and sends."""
    from disttrain.parallel import mesh

    p, schedule = cfg.parallel.pipeline, cfg.parallel.pipeline_schedule
    ranks = [[stages[s] for s in mesh.stages_of(rank, p, len(stages), schedule)] for rank in range(p)]
    held = ", ".join(f"{sum(s.n_layer for s in mine)} block{'s' * (sum(s.n_layer for s in mine) != 1)} "
                     f"({sum(s.params for s in mine) / 1e6:,.1f} M)" for mine in ranks)
    inner = [s.n_layer for s in stages[1:-1]]  # (the ends hold the embedding and the head besides)
    uneven = (f"; its stages between the ends hold {min(inner)} to {max(inner)} blocks, and a round of the schedule "
              "moves at its heaviest stage's pace" if inner and min(inner) != max(inner) else "")
    return (f"- pipeline of {p} ranks (parallel.pipeline, {schedule}, {len(stages) // p} stage"
            f"{'s' * (len(stages) > p)} a rank{uneven}): a group's ranks share "
            f"its batch (tokens per GPU: 1/{p * max(1, cfg.parallel.tensor) * max(1, cfg.parallel.context)} of "
            f"them), in {micro_batches} micro-batches; the ranks hold {held} "
            f"(disttrain's split: embeddings on the first, the head on the last); {send / 2**20:,.2f} MiB of "
            f"activations cross a stage boundary each micro-batch, each way; the strategy runs over each stage's "
            f"GPUs / {p}")


def sweep_jobs(args: argparse.Namespace, cfg: Config, strategies: list[str]) -> list[tuple[str, Config]]:
    """(setting, config) of each forecast: the config (setting ''), or one per value of `--sweep` (a setting of
    `FORECAST_SWEEPS` that one of `strategies` reads, or the config's strategy where none is given), applied to it."""
    if not args.sweep:
        return [("", cfg)]
    from disttrain.bench.scaling import parse_sweep, reads
    from disttrain.config import load_config

    key = args.sweep.partition("=")[0]
    if key not in FORECAST_SWEEPS:
        raise ConfigError(f"--sweep {key}: a forecast sweeps a setting that changes only a step's collectives "
                          f"({', '.join(FORECAST_SWEEPS)}: the last six the model's splits); forecast each value of "
                          f"{key} on its own (--set {key}=...)")
    if key in SPLITS and (args.compute_s or args.interconnect.startswith("measured:")):
        raise ConfigError(f"--sweep {key}: each value's compute is a GPU's share of the FLOPs, which a given "
                          "--compute-s (one split's) does not say; leave --compute-s and a measured interconnect out")
    key, values = parse_sweep(args.sweep)
    jobs = [(f"{key}={value}", load_config(args.config, [*args.overrides, f"{key}={value}"])) for value in values]
    names = strategies or list(dict.fromkeys("fsdp" if args.model else config_strategy(c) for _, c in jobs))
    if not any(reads(name, key) for name in names):
        raise ConfigError(f"--sweep {key}: {', '.join(names)} do{'es' if len(names) == 1 else ''} not read it; "
                          "give --strategy with one that does")
    return jobs


def _forecast_batch(args: argparse.Namespace, cfg: Config) -> tuple[int, int, str]:
    """(sequences per GPU per step, per forward pass, where they come from), checked."""
    local, micro = (args.local_batch, args.local_batch) if args.local_batch else default_batch(args, cfg)
    micro = args.micro_batch or micro  # (--local-batch alone: no accumulation)
    group = split_group(cfg)
    given = ("--local-batch" if args.local_batch else "the preset's" if args.model else
             f"the config's: data.global_batch_size {cfg.data.global_batch_size} over dist.nproc {cfg.dist.nproc}"
             + (f" / {group} ({SPLIT_NAMES})" if group > 1 else "")
             + (f" x {args.nodes} nodes" if args.nodes > 1 else ", one node's ranks"))
    if local % micro:
        per = "group" if group > 1 else "GPU"
        raise ConfigError(f"--micro-batch {micro}: the batch per {per}, {local} ({given}), is not a multiple of it; "
                          "give a divisor of it, or --local-batch")
    return local, micro, given


def _compute(args, shape: ModelShape, tokens: float, precision: str, fit: dict | None, local: int, micro: int,
             pipeline: int = 1) -> tuple[float, str]:
    """(seconds of one step's compute on one device, where they come from): given, or from FLOPs; a measured
    interconnect needs it given. Under a pipeline `--compute-s` is the whole model's step on one device (as
    `--measure --world-sizes 1` times it), a GPU's share 1/p of it; under a tensor or context split one rank's (as
    it times them too, on a fake group)."""
    if args.compute_s:
        if pipeline > 1:
            return args.compute_s / pipeline, f"given (--compute-s {args.compute_s:g}, the whole model's, / {pipeline})"
        return args.compute_s, "given (--compute-s)"
    if fit is not None:
        how = ("" if args.model else f": the 1-rank step_time_s of `disttrain bench predict [CONFIG] --measure "
               f"--world-sizes 1 --local-batch {local} --micro-batch {micro}`")
        raise ConfigError(f"--interconnect measured:...: give --compute-s, one device's step of {local} sequences in "
                          f"micro-batches of {micro}{how}")
    tflops = args.tflops or (H100_FP32_TFLOPS if precision == "fp32" else H100_BF16_TFLOPS)
    return compute_seconds(shape, tokens, tflops, args.mfu), (
        f"{shape.flops_per_token():.3g} FLOPs/token / ({tflops:g} TFLOP/s x MFU {args.mfu:g}"
        + ("" if args.tflops else f"; the H100's dense peak in {precision}") + ")")


def _table(rows: list[dict]) -> list[str]:
    swept = "setting" in rows[0]
    head = ("| strategy | " + ("setting | " if swept else "") + "GPUs | step (s) | compute (s) | collectives (s) | "
            "exposed (s) | tokens/s per GPU | efficiency |")
    return [head, "|---" * head.count(" | ") + "|---|"] + [
        f"| {r['strategy']} | " + (f"{r['setting']} | " if swept else "") + f"{r['gpus']} | {r['step_s']:.4f} | "
        f"{r['compute_s']:.4f} | {r['comm_s']:.4f} | {r['exposed_s']:.4f} | {r['tokens_per_s_per_gpu']:,.1f} | "
        f"{r['efficiency']:.3f} |" for r in rows]


def report_date() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


def report_footer() -> str:
    from disttrain._version import __version__

    return f"disttrain {__version__}, Python {platform.python_version()}, {platform.node()}."
