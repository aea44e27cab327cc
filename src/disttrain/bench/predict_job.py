"""What `disttrain bench predict` models of a config's job: its model counted from the module tree (`counted_shape`),
its batch per GPU and accumulation (`config_batch`), the strategy the job runs on several ranks (`config_strategy`),
the settings that change a step's collectives (`settings`), a tensor split's collectives (`tensor_calls_of`) and
what each pipeline rank holds (`pipeline_stages`); for a measured series of `bench scaling --sweep`, the config with
its swept setting (`series_settings`)."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import NamedTuple

from disttrain.bench.interconnect import ITEMSIZE
from disttrain.bench.model_shapes import ModelShape, UnitShape, joined
from disttrain.bench.scale_model import COMPRESSED, SPLIT_NAMES, STRATEGIES, WIRE_DTYPES
from disttrain.config import Config, ModelConfig
from disttrain.errors import ConfigError

MODELLED_SWEEPS = ("parallel.bucket_cap_mb", "parallel.grad_compression", "parallel.powersgd_rank",
                   "parallel.hsdp_shard_size", "parallel.fsdp_prefetch", "train.log_every",
                   "parallel.activation_checkpointing", "data.", "optim.")
"""`bench scaling --sweep` keys a measured series can be predicted under: what `settings` takes, the batch (the
rows' columns) and what changes compute only (measured in the series' own 1-rank row). A sweep of another key (the
model, the precision, a strategy's layout) is listed as not predicted."""


def counted_shape(model_cfg: ModelConfig) -> ModelShape:
    """The config's model as the scale model sees it, counted from its module tree built on the meta device (no
    memory): its units (what lies outside the transformer blocks, then each block), their parameters, those that
    train (model.freeze), their forward and backward FLOPs per token (`perf.flops_by_unit`), and the trained
    tensors' sizes (DDP's buckets hold whole tensors)."""
    from disttrain.bench.tensor_calls import meta_built
    from disttrain.parallel.activation_checkpoint import transformer_blocks
    from disttrain.perf import flops_by_unit, key_width

    model = meta_built(model_cfg, f"model.name = {model_cfg.name!r}", "it",
                       "use --model PRESET, or --compute-s with a preset of the same size")
    blocks = transformer_blocks(model)
    inside = {id(p) for block in blocks for p in block.parameters()}
    groups = [[p for p in model.parameters() if id(p) not in inside]] + [list(b.parameters()) for b in blocks]
    units = tuple(UnitShape(sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad),
                            forward, backward)
                  for params, (forward, backward) in zip(groups, flops_by_unit(model, model_cfg.seq_len), strict=True))
    if not sum(u.forward_flops for u in units):
        raise ConfigError(f"model.name = {model_cfg.name!r}: no parameter of the model multiplies activations, so its "
                          "FLOPs and its share of them per block cannot be counted; use --model PRESET, or "
                          "--compute-s with a preset of the same size")
    params = sum(u.params for u in units)
    name = (f"gpt {len(blocks)}x{model_cfg.d_model}" if model_cfg.name == "gpt"
            else f"{type(model).__name__} of {len(blocks)} blocks")
    return ModelShape(name, params, (params - units[0].params) / max(1, len(blocks)), len(blocks),
                      seq_len=model_cfg.seq_len, counted=units, kv_width=key_width(model),
                      grad_tensors=tuple(p.numel() for p in model.parameters() if p.requires_grad),
                      grad_rows=tuple(p.shape[0] if p.dim() > 1 else 0 for p in model.parameters() if p.requires_grad))


def model_sizes(model) -> dict[str, int]:
    """A model's parameters and the trained ones (model.freeze), the columns `params` and `trained_params` of a
    measured CSV, by which `bench predict --validate` tells it was measured on the job it is given."""
    params = list(model.parameters())
    return {"params": sum(p.numel() for p in params),
            "trained_params": sum(p.numel() for p in params if p.requires_grad)}


def config_sizes(model_cfg: ModelConfig) -> dict[str, int | str]:
    """`model_sizes` of the config's model built on the meta device; blank where it cannot be built there (a factory
    of the user's that reads values): a CSV's blank columns go unchecked."""
    from disttrain.memory import meta_model

    try:
        return model_sizes(meta_model(model_cfg))
    except Exception:
        return {"params": "", "trained_params": ""}


def config_batch(cfg: Config, nodes: int = 1) -> tuple[int, int]:
    """(sequences per GPU per step, sequences per forward pass) of the config's job: `data.global_batch_size` over
    its ranks, `dist.nproc` on each of its `nodes` (a launch's `--nnodes`, which the config does not hold), in
    micro-batches of `data.micro_batch_size` (the Trainer accumulates the rest, and reduces the gradients on the last
    micro-batch only); under a model split, over its groups (`split_group`: the ranks that read one batch), and
    per group. A forecast keeps this batch per GPU (per group) at every count (weak
    scaling)."""
    d, world = cfg.data, cfg.dist.nproc * nodes
    group = split_group(cfg)
    names, values = ("dist.nproc x --nodes", f"{cfg.dist.nproc} x {nodes}") if nodes > 1 else ("dist.nproc", f"{world}")
    if world % group:
        raise ConfigError(f"{SPLIT_NAMES} = {group} does not divide {names} = {values} ranks: "
                          "the job's groups are unknown; give degrees that divide its ranks")
    groups = world // group
    if world < 1 or d.micro_batch_size < 1 or d.global_batch_size < 1 or \
            d.global_batch_size % (groups * d.micro_batch_size):
        over = f" / {group} (tensor x pipeline x context)" if group > 1 else ""
        raise ConfigError(f"data.global_batch_size = {d.global_batch_size} is not a positive multiple of "
                          f"data.micro_batch_size x {names}{over} = {d.micro_batch_size} x {values}{over}: the job's "
                          "batch per GPU is unknown; fix them, or give --local-batch and --micro-batch")
    return d.global_batch_size // groups, d.micro_batch_size


def wire_dtypes(precision: str, grad_compression: str) -> list[str]:
    """The element types a step of the job sends (float32 first: the step's small collectives, and what every other
    type falls back to): those a sitting's comm fit measures, so that each collective is priced in its own."""
    sent = [*WIRE_DTYPES.get(precision, ()), COMPRESSED.get(grad_compression, "float32")]
    return list(dict.fromkeys(["float32", *sent]))


def config_strategy(cfg: Config) -> str:
    """The modelled strategy the config's job runs on several ranks: `auto` is ddp there, DeepSpeed's stages 0-3
    are ddp, zero1, zero2 and fsdp (ZeRO-3), fsdp that keeps its parameters gathered after forward
    (`parallel.reshard_after_forward = false`) is zero2, hsdp of one sharding group (`parallel.hsdp_shard_size` 0:
    every rank) is fsdp. One line for what the model does not have: `single`, an unknown name, hsdp kept
    gathered."""
    from disttrain.parallel import registry

    p = cfg.parallel
    name = registry.resolve(p.strategy, 2).name  # (an unknown name: the registry's one line)
    if name == "deepspeed" and 0 <= p.deepspeed_stage <= 3:
        name = ("ddp", "zero1", "zero2", "fsdp")[p.deepspeed_stage]
    if name == "hsdp" and p.hsdp_shard_size == 0:  # (every rank one sharding group: plain FSDP)
        name = "fsdp"
    if name in ("fsdp", "hsdp") and not p.reshard_after_forward:
        if name == "hsdp":
            raise ConfigError("parallel.reshard_after_forward = false with hsdp is not modelled (hsdp is modelled "
                              "gathering again for backward); give --strategy zero2, or leave the setting out")
        name = "zero2"
    if name not in STRATEGIES:
        raise ConfigError(f"parallel.strategy = {p.strategy!r} is not modelled; give --strategy (one or more of "
                          f"{', '.join(STRATEGIES)})")
    return name


def settings(cfg: Config) -> dict:
    """What a config sets of a step's collectives that the scale model takes, as `Workload`'s fields: the steps per
    logged line (each gathers the ranks' figures), DDP's bucket size, the gradients' compression (powersgd with its
    rank), hsdp's shard size, FSDP's prefetch depth, the tensor split's degree, the pipeline's degree and schedule
    (the two together: each stage split) and the context split's degree. (Not taken: `parallel.cpu_offload`, whose
    copies are in the compute time given or measured.)"""
    from disttrain.config import CHOICES
    from disttrain.parallel import mesh

    p, choices = cfg.parallel, CHOICES["parallel.grad_compression"]
    mesh.check_stages_per_rank(p)
    if p.grad_compression not in choices:
        raise ConfigError(f"parallel.grad_compression = {p.grad_compression!r}: choose from {', '.join(choices)}")
    if not (p.bucket_cap_mb > 0 and math.isfinite(p.bucket_cap_mb)):
        raise ConfigError(f"parallel.bucket_cap_mb = {p.bucket_cap_mb}: must be > 0; e.g. 25 (DDP's default)")
    for key in ("hsdp_shard_size", "fsdp_prefetch"):
        if getattr(p, key) < 0:
            raise ConfigError(f"parallel.{key} = {getattr(p, key)}: must be >= 0")
    if cfg.train.log_every < 1:
        raise ConfigError(f"train.log_every = {cfg.train.log_every}: must be >= 1; e.g. 10 (the default)")
    return {"log_every": cfg.train.log_every, "bucket_bytes": p.bucket_cap_mb * 2**20,
            "grad_compression": p.grad_compression, "powersgd_rank": p.powersgd_rank,
            "hsdp_shard": p.hsdp_shard_size, "prefetch": p.fsdp_prefetch or 1, "tensor": max(1, p.tensor),
            "pipeline": max(1, p.pipeline), "schedule": p.pipeline_schedule, "virtual": p.pipeline_stages_per_rank,
            "context": max(1, p.context)}


def split_group(cfg: Config) -> int:
    """GPUs that read one batch together: parallel.tensor x parallel.pipeline x parallel.context."""
    p = cfg.parallel
    return max(1, p.tensor) * max(1, p.pipeline) * max(1, p.context)


def context_calls_of(cfg: Config, shape: ModelShape, precision: str, sequences: float
                     ) -> tuple[tuple[str, str, float, str], ...]:
    """The context split's collectives of a micro-batch of `sequences` sequences (`Workload.context_calls`): each
    attention's keys and values in the compute dtype of FSDP2's gathered copies (disttrain runs a context split's
    data axis as FSDP2) and their gradients, gathered again in backward under activation checkpointing
    (`model_split.context_calls`), a tensor rank's heads' under a tensor split; () where `parallel.context` is 1."""
    from disttrain.bench.model_split import context_calls

    if cfg.parallel.context <= 1:
        return ()
    t = max(1, cfg.parallel.tensor)  # (a tensor rank's keys: its heads')
    calls = context_calls(replace(shape, kv_width=shape.kv_width // t), WIRE_DTYPES[precision][1],
                          cfg.parallel.activation_checkpointing)
    return scaled_calls(calls, sequences)


def tensor_calls_of(cfg: Config, shape: ModelShape, precision: str, sequences: float, data_axis: bool = False
                    ) -> tuple[tuple[str, str, float, str], ...]:
    """The tensor split's collectives of a step in micro-batches of `sequences` sequences (`Workload.tensor_calls`):
    recorded from the config's model under disttrain's plan (`tensor_calls.count`), or in closed form for a preset;
    () where `parallel.tensor` is 1 or a pipeline splits the model too (`stage_calls_of`). A forward's and a
    backward's sizes are one sequence's times `sequences`; the step's (part "step") are the parameters'.
    `data_axis`: data-parallel ranks beside the split (FSDP2: under a mixed precision the stream's calls in the
    compute dtype, `tensor_calls.count`)."""
    from disttrain.bench import tensor_calls

    if cfg.parallel.tensor <= 1 or cfg.parallel.pipeline > 1:
        return ()
    if shape.counted:
        calls = _plain(tensor_calls.count(cfg, precision, data_axis))
    else:
        calls = _preset_calls(cfg, shape, precision, data_axis)
    return scaled_calls(tuple(calls), sequences / max(1, cfg.parallel.context))  # (a context split: a rank's share)


class SplitCalls(NamedTuple):
    stages: tuple[tuple[tuple[str, str, float, str], ...], ...]
    """Each pipeline stage's forward and backward calls (`Workload.stage_calls`)."""
    steps: tuple[tuple[tuple[str, str, float, str], ...], ...]
    """Each pipeline rank's step calls (`Workload.step_calls`)."""


def stage_calls_of(cfg: Config, shape: ModelShape, precision: str, sequences: float, data_axis: bool = False
                   ) -> SplitCalls:
    """Under a pipeline with a tensor split, `tensor_calls_of`'s calls of each stage in micro-batches of `sequences`
    and of each rank's step (`tensor_calls.count_stages`, or each stage's blocks and ends in closed form for a
    preset, and each rank's step over its stages); ((), ()) otherwise."""
    from disttrain.bench import tensor_calls
    from disttrain.parallel import mesh

    p = cfg.parallel.pipeline
    if cfg.parallel.tensor <= 1 or p <= 1:
        return SplitCalls((), ())
    count = mesh.stage_count(cfg.parallel, p)
    held = [mesh.stages_of(rank, p, count, cfg.parallel.pipeline_schedule) for rank in range(p)]
    if shape.counted:
        recorded = tensor_calls.count_stages(cfg, precision, data_axis)
        stages, steps = ([_plain(calls) for calls in recorded.stages], [_plain(calls) for calls in recorded.steps])
    else:
        bounds = _preset_bounds(cfg, shape)
        stages = [[c for c in _preset_calls(cfg, shape, precision, data_axis, hi - lo, s == 0, s == count - 1)
                   if c[0] != "step"] for s, (lo, hi) in enumerate(bounds)]
        steps = [[c for c in _preset_calls(cfg, shape, precision, data_axis, sum(bounds[s][1] - bounds[s][0]
                                                                               for s in mine), 0 in mine,
                                           count - 1 in mine) if c[0] == "step"] for mine in held]
    return SplitCalls(tuple(scaled_calls(tuple(calls), sequences) for calls in stages),
                      tuple(tuple(calls) for calls in steps))


def pipeline_orders(cfg: Config, microbatches: int) -> tuple[tuple[tuple[int, str], ...], ...]:
    """Each pipeline rank's computations in a step of `microbatches`, in the order torch's schedule class runs
    them (`parallel/placement.torch_order`: (stage, F | B | I | W)), for the schedules of several stages a rank
    (`Workload.orders`); () for gpipe and 1f1b (the timeline writes theirs), or without a pipeline."""
    from disttrain.parallel import mesh
    from disttrain.parallel.placement import torch_order

    p, schedule = cfg.parallel.pipeline, cfg.parallel.pipeline_schedule
    if p <= 1 or schedule not in mesh.VIRTUAL_SCHEDULES:
        return ()
    orders = [torch_order(schedule, p, rank, microbatches, mesh.stages_per_rank(cfg.parallel)) for rank in range(p)]
    if any(order is None for order in orders):
        raise ConfigError(f"parallel.pipeline_schedule = {schedule!r}: this torch does not give its schedule's order "
                          "of computations, which the model plays; predict gpipe or 1f1b")
    return tuple(tuple(order) for order in orders)


def _plain(calls) -> list[tuple[str, str, float, str]]:
    return [(c.part, c.collective, c.nbytes, c.dtype) for c in calls]


def _preset_calls(cfg: Config, shape: ModelShape, precision: str, data_axis: bool, blocks: int | None = None,
                  first: bool = True, last: bool = True) -> tuple[tuple[str, str, float, str], ...]:
    """A preset's calls of one sequence in closed form (`model_shapes.tensor_calls`), as disttrain's plan runs the
    config: its logits split where loss parallel is (`parallel/tensor.splits_logits`), its blocks recomputed under
    activation checkpointing, the stream in FSDP2's gathered dtype beside a data axis."""
    from types import SimpleNamespace

    from disttrain.bench import model_shapes
    from disttrain.parallel.tensor import splits_logits

    if not shape.columns:
        raise ConfigError(f"parallel.tensor = {cfg.parallel.tensor}: {shape.name} has no tensor-parallel plan; "
                          "predict it with parallel.tensor = 1")
    p = cfg.parallel
    stored, gathered, _ = WIRE_DTYPES[precision]
    split = splits_logits(p, SimpleNamespace(tensor=p.tensor, pipeline=p.pipeline), shape.vocab)
    return model_shapes.tensor_calls(shape, stored, gathered, p.sequence_parallel, cfg.optim.grad_clip > 0,
                                     stream=gathered if data_axis else stored, blocks=blocks, first=first,
                                     last=last, split_logits=split, recompute=p.activation_checkpointing)


def scaled_calls(calls: tuple, sequences: float) -> tuple:
    """A split's calls of one sequence (`tensor_calls_of(..., 1)`: under a context split a rank's share of one) in a
    micro-batch of `sequences`: the forward's and backward's sizes times it, the step's (the parameters') as they
    are."""
    return tuple((part, collective, nbytes * (1 if part == "step" else sequences), dtype)
                 for part, collective, nbytes, dtype in calls)


def series_settings(config: str | None, overrides: list[str], cfg: Config, swept: str) -> dict:
    """The settings of a measured series: the config's, with the setting its `bench scaling --sweep` swept (a
    ConfigError where the sweep's key is not modelled)."""
    from disttrain.config import load_config

    if not swept:
        return settings(cfg)
    key = swept.partition("=")[0]
    if not any(key == m or (m.endswith(".") and key.startswith(m)) for m in MODELLED_SWEEPS):
        raise ConfigError(f"its sweep of {key} is not modelled")
    return settings(load_config(config, [*overrides, swept]))


class PipelineSplit(NamedTuple):
    stages: tuple[ModelShape, ...]
    """What each pipeline stage holds, in stage order (`Workload.stages`)."""
    send_bytes: float
    """Bytes a sequence's activations carry across a stage boundary (x the micro-batch: `Workload.send_bytes`)."""
    tied_bytes: float
    """Bytes of the weights the first and last stage both hold, whose gradients they sum (`Workload.tied_bytes`)."""


def pipeline_stages(cfg: Config, shape: ModelShape, precision: str, data_axis: bool = False) -> PipelineSplit:
    """What each pipeline stage holds, the bytes a sequence's activations carry across a stage boundary and those of
    a tied embedding and head, under `parallel.pipeline`; ((), 0, 0) without one. disttrain's own split
    (parallel/stages.py): stages of consecutive blocks balanced by parameters, the embeddings on the first stage and
    the head on the last (`parallel.pipeline_split` where given), p x v of them. A stage's units: its blocks, after
    a unit of its embedding (the first) or head (the last: the root's FLOPs, the head's matmul). The stream between
    stages is counted in the parameters' dtype, or beside a data axis (`data_axis`) in FSDP2's compute dtype (bf16
    under bf16-mixed), a tensor rank's share of it under sequence parallelism (the stream is split along the
    sequence) or a context split (its pieces of the sequence), and a tied weight's rows too (split by vocabulary).
    A preset's root is split half and half."""
    from disttrain.parallel import mesh
    from disttrain.parallel import stages as pipe
    from disttrain.parallel.state import tie_groups

    p = cfg.parallel.pipeline
    if p <= 1:
        return PipelineSplit((), 0.0, 0.0)
    count = mesh.stage_count(cfg.parallel, p)
    units, stream, tied = shape.units(), ITEMSIZE[WIRE_DTYPES[precision][1 if data_axis else 0]], 0.0
    if shape.counted:
        from disttrain.memory import meta_model
        from disttrain.parallel.tensor import hidden_size

        model = meta_model(cfg.model)
        family = pipe.FAMILIES[pipe.family_of(model)]

        def size(names, trained=False):
            params = {id(q): q for n in names for q in model.get_submodule(n).parameters()}.values()
            return sum(q.numel() for q in params if q.requires_grad or not trained)
        bounds = pipe.stage_bounds(model, count, cfg.parallel.pipeline_split)
        ends = (UnitShape(size(family.embeddings), size(family.embeddings, True), 0.0, 0.0),
                UnitShape(size(family.head), size(family.head, True), units[0].forward_flops, units[0].backward_flops))
        hidden = hidden_size(model)
        owners = [{n.rpartition(".")[0] for n in names} for names in tie_groups(model)]  # (modules sharing one)
        tied = sum(model.get_parameter(names[0]).numel() for names, held in zip(tie_groups(model), owners, strict=True)
                   if model.get_parameter(names[0]).requires_grad and held & set(family.embeddings)
                   and held & set(family.head)) * ITEMSIZE[WIRE_DTYPES[precision][0]]
    else:
        half = units[0].params / 2
        bounds = _preset_bounds(cfg, shape)
        ends = (UnitShape(half, half, 0.0, 0.0), UnitShape(half, half, units[0].forward_flops, units[0].backward_flops))
        hidden = shape.d_model
    parts = tuple(joined(f"{shape.name}, stage {s}", [ends[0]] * (s == 0) + [ends[1]] * (s == count - 1),
                         [units[1 + i] for i in range(*bounds[s])], shape.seq_len) for s in range(count))
    t = max(1, cfg.parallel.tensor)  # (each tensor rank sends its share of a sequence-split stream, sums its rows)
    c = max(1, cfg.parallel.context)  # (each context rank its pieces of every sequence)
    return PipelineSplit(parts, shape.seq_len * hidden * stream / (t if cfg.parallel.sequence_parallel else 1) / c,
                         tied / t)


def _preset_bounds(cfg: Config, shape: ModelShape) -> list[tuple[int, int]]:
    """[first block, end) of each pipeline stage of a preset: disttrain's balanced split, its root's parameters half
    on the first stage and half on the last."""
    from disttrain.parallel import mesh
    from disttrain.parallel import stages as pipe

    if cfg.parallel.pipeline_split.strip():
        raise ConfigError(f"parallel.pipeline_split = {cfg.parallel.pipeline_split!r}: {shape.name} has no "
                          "module names to split at; model a config of the model, or leave the split to balance")
    units = shape.units()
    half = units[0].params / 2
    cuts = pipe.balanced_split([u.params for u in units[1:]], mesh.stage_count(cfg.parallel, cfg.parallel.pipeline),
                               half, half)
    return list(zip([0, *cuts], [*cuts, len(units) - 1], strict=True))
