"""The layout of a job on its ranks: pipeline x data (replicate, shard) x context x tensor, as pure arithmetic.

    MeshLayout(pipeline=2, replicate=1, shard=2, tensor=1)   # 4 ranks: 2 stages, each FSDP over 2 ranks

Ranks are laid out row-major over the axes `AXES` (pipeline outermost, tensor innermost, as torchtitan does, so
that a tensor-parallel group is made of neighbouring ranks: the GPUs of one node). `layout_for(cfg, world)` turns
the settings into a layout and refuses an impossible one in one line, before any process starts; `device_mesh`
builds torch's `DeviceMesh` with those axis names on a running job (parallel/compose.py).

The data-parallel degree is what the strategy makes of the ranks left over by `parallel.pipeline`,
`parallel.context` and `parallel.tensor`: replicated (ddp), sharded (fsdp, zero2), or both (hsdp) - each spec's
`data_axes` says which. Every rank of one data-parallel coordinate (its pipeline stages, sequence pieces and tensor
shards) reads the same samples. Context-parallel ranks take part in the gradient reduction as data ranks do
(their pieces are different tokens): the `DeviceMesh` folds the `cp` axis into the data axis next to it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from disttrain.errors import ConfigError

if TYPE_CHECKING:
    from disttrain.config import Config, ParallelConfig
    from disttrain.parallel.spec import StrategySpec

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""The layout's axis names, outermost first."""
MESH_AXES = ("pp", "dp_replicate", "dp_shard", "tp")
"""The `DeviceMesh`'s: `cp` folded into the data axis next to it (`MeshLayout.mesh_shape`)."""


@dataclass(frozen=True)
class MeshLayout:
    pipeline: int = 1
    replicate: int = 1
    shard: int = 1
    tensor: int = 1
    v_shaped: bool = False
    """A V-shaped pipeline schedule (`V_SCHEDULES`): the last stage runs on pipeline rank 0, not the last rank."""
    context: int = 1
    context_sharded: bool = False
    """The strategy shards parameters (fsdp, zero2, hsdp): context ranks join the sharded data axis, else the
    replicated one."""

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return self.pipeline, self.replicate, self.shard, self.context, self.tensor

    @property
    def mesh_shape(self) -> tuple[int, int, int, int]:
        """The DeviceMesh's shape over `MESH_AXES`: context ranks join the sharded data axis of a sharding strategy,
        else the replicated one (the ranks stay in row-major order: cp is next to dp_shard, whose size is 1 then)."""
        if self.context_sharded:
            return self.pipeline, self.replicate, self.shard * self.context, self.tensor
        return self.pipeline, self.replicate * self.context, self.shard, self.tensor

    @property
    def world(self) -> int:
        return math.prod(self.shape)

    @property
    def data(self) -> int:
        """Data-parallel degree: how many different batches one step reads."""
        return self.replicate * self.shard

    @property
    def model_parallel(self) -> bool:
        """Whether the model or its sequences are split (pipeline stages, tensor shards, sequence pieces), not only
        the data."""
        return self.pipeline > 1 or self.tensor > 1 or self.context > 1

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index on each axis."""
        out, rest = {}, rank
        for axis, size in zip(reversed(AXES), reversed(self.shape), strict=True):
            out[axis] = rest % size
            rest //= size
        return {axis: out[axis] for axis in AXES}

    def data_rank(self, rank: int) -> int:
        """Which of the `data` batch shards this rank reads."""
        c = self.coords(rank)
        return c["dp_replicate"] * self.shard + c["dp_shard"]

    def counts_loss(self, rank: int) -> bool:
        """Whether this rank's loss joins the global totals: one rank per data shard and share of the sequences (the
        one of the last pipeline stage, tensor shard 0) - the others compute the same loss, or none."""
        c = self.coords(rank)
        return c["pp"] == (0 if self.v_shaped else self.pipeline - 1) and c["tp"] == 0

    def counts_outputs(self, rank: int) -> bool:
        """Whether this rank's whole outputs (`forward()`) count: one rank per data shard (context ranks each hold
        the whole sequence's, joined)."""
        return self.counts_loss(rank) and self.coords(rank)["cp"] == 0

    def describe(self) -> str:
        parts = [f"{name}{size}" for name, size in zip(AXES, self.shape, strict=True) if size > 1]
        return " x ".join(parts) or "1 rank"


def layout_for(p: ParallelConfig, world: int, spec: StrategySpec | None = None) -> MeshLayout:
    """The layout the `parallel` settings ask for on `world` ranks; ConfigError (one line: the setting and the fix)
    when the degrees do not multiply to the world size or the strategy does not compose with them."""
    from disttrain.parallel import registry

    spec = spec or registry.resolve(p.strategy, world)
    for key in ("pipeline", "tensor", "context"):
        value = getattr(p, key)
        if value < 1:
            raise ConfigError(f"parallel.{key} = {value}: must be >= 1 (1 = not split)")
    if p.context > 1 and p.pipeline > 1 and p.tensor > 1:
        raise ConfigError(f"parallel.context = {p.context} composes with parallel.pipeline or with parallel.tensor, "
                          "not with both yet; set parallel.tensor = 1, parallel.pipeline = 1 or parallel.context = 1")
    if p.compile:
        from disttrain.parallel.activation_checkpoint import check_compile

        check_compile(p)
    split = p.pipeline * p.tensor * p.context
    if world % split:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        names = "parallel.pipeline x parallel.tensor x parallel.context"
        degrees = f"{p.pipeline} x {p.tensor} x {p.context} = {split}"
        raise ConfigError(f"{names} = {degrees} does not divide the world size {world}; choose degrees whose "
                          f"product divides {world} ({divisors}) or run on a multiple of {split} processes")
    data = world // split
    if split > 1 and spec.data_axes is None:
        raise ConfigError(f"parallel.strategy = {spec.name!r} does not compose with parallel.pipeline / "
                          f"parallel.tensor / parallel.context; use 'ddp', 'fsdp', 'zero2' or 'hsdp' for the "
                          "data-parallel axis")
    replicate, shard = spec.data_axes(p, data) if spec.data_axes is not None else (data, 1)
    if p.context > 1 and shard > 1 and not spec.shards_parameters:  # (mesh_shape folds cp into a data axis next to it)
        raise ConfigError(f"parallel.strategy = {spec.name!r} lays out a sharded data axis without sharding "
                          "parameters; parallel.context does not compose with it: use 'ddp', 'fsdp', 'zero2' or 'hsdp'")
    return MeshLayout(p.pipeline, replicate, shard, p.tensor, p.pipeline > 1 and p.pipeline_schedule in V_SCHEDULES,
                      p.context, p.context > 1 and spec.shards_parameters)


def check_model_split(cfg: Config, layout: MeshLayout) -> None:
    """The model's shape against the layout (the reference GPT's sizes are in the config; a model of your own is
    checked when it is split)."""
    p, m = cfg.parallel, cfg.model
    if layout.model_parallel and p.grad_compression == "powersgd":
        raise ConfigError("parallel.grad_compression = 'powersgd' is a DDP communication hook, and with "
                          "parallel.pipeline, parallel.tensor or parallel.context > 1 the data axis runs through "
                          "FSDP2; use 'bf16' or 'fp16'")
    if p.pipeline_split.strip() and layout.pipeline == 1:
        raise ConfigError(f"parallel.pipeline_split = {p.pipeline_split!r} needs parallel.pipeline > 1; set "
                          "parallel.pipeline or remove parallel.pipeline_split")
    if p.sequence_parallel and layout.tensor == 1:
        raise ConfigError("parallel.sequence_parallel = true needs parallel.tensor > 1; set parallel.tensor or "
                          "remove parallel.sequence_parallel")
    if m.name == "gpt" and layout.tensor > 1:
        for key, value in (("n_head", m.n_head), ("d_model", m.d_model), ("vocab_size", m.vocab_size)):
            if value % layout.tensor:
                raise ConfigError(f"model.{key} = {value} is not divisible by parallel.tensor = {layout.tensor}; "
                                  f"choose a tensor degree that divides it")
    if layout.context > 1 and m.seq_len % (2 * layout.context):
        raise ConfigError(f"model.seq_len = {m.seq_len} is not divisible by 2 x parallel.context "
                          f"(= {2 * layout.context}: each rank takes two of as many equal pieces of every sequence); "
                          "choose a sequence length or degree that divides")
    if p.sequence_parallel and layout.context > 1 and (m.seq_len // layout.context) % layout.tensor:
        raise ConfigError(f"model.seq_len = {m.seq_len}: a rank's share (1/parallel.context = 1/{layout.context} of "
                          f"it) is not divisible by parallel.tensor = {layout.tensor} (sequence parallelism splits it);"
                          " choose a sequence length that divides, or parallel.sequence_parallel = false")
    if p.sequence_parallel and m.seq_len % layout.tensor:
        raise ConfigError(f"model.seq_len = {m.seq_len} is not divisible by parallel.tensor = {layout.tensor} "
                          "(sequence parallelism splits the sequence); choose a divisor, or "
                          "parallel.sequence_parallel = false")
    check_stages_per_rank(p)
    if layout.pipeline > 1:
        stages = layout.pipeline * stages_per_rank(p)
        if m.name == "gpt" and m.n_layer < stages:
            raise ConfigError(f"model.n_layer = {m.n_layer} blocks cannot fill {stages} pipeline stages "
                              f"(parallel.pipeline = {layout.pipeline}, schedule {p.pipeline_schedule!r}); use "
                              f"parallel.pipeline <= {max(1, m.n_layer // (stages // layout.pipeline))} or more layers")
        micro = cfg.data.global_batch_size // (layout.data * cfg.data.micro_batch_size)
        if p.pipeline_microbatches and p.pipeline_microbatches != micro:
            raise ConfigError(
                f"parallel.pipeline_microbatches = {p.pipeline_microbatches}, but data.global_batch_size / "
                f"(data-parallel degree {layout.data} x data.micro_batch_size {cfg.data.micro_batch_size}) = {micro} "
                f"micro-batches per step; set data.micro_batch_size = "
                f"{_micro_for(cfg.data.global_batch_size, layout.data, p.pipeline_microbatches)} or remove "
                "parallel.pipeline_microbatches")
        if p.pipeline_schedule == "dualpipev" and micro < 2 * layout.pipeline:
            raise ConfigError(f"parallel.pipeline_schedule = 'dualpipev' needs at least as many micro-batches per step "
                              f"as stages ({2 * layout.pipeline}), and the step has {micro}; lower "
                              "data.micro_batch_size or raise data.global_batch_size, or use 'zbv'")
        if p.pipeline_schedule in VIRTUAL_SCHEDULES and p.pipeline_schedule not in V_SCHEDULES \
                and micro % layout.pipeline:
            raise ConfigError(f"parallel.pipeline_schedule = {p.pipeline_schedule!r} needs the micro-batches per step "
                              f"({micro}) to be a multiple of parallel.pipeline = {layout.pipeline}; change "
                              "data.micro_batch_size or data.global_batch_size")


def stage_count(parallel, ranks: int) -> int:
    """Stages over `ranks` pipeline ranks: `stages_per_rank` each."""
    return ranks * stages_per_rank(parallel)


def stages_per_rank(parallel) -> int:
    """Stages each pipeline rank runs: `parallel.pipeline_stages_per_rank`, or the schedule's (two, virtual, for
    the interleaved and V-shaped schedules, else one)."""
    return parallel.pipeline_stages_per_rank or (2 if parallel.pipeline_schedule in VIRTUAL_SCHEDULES else 1)


def holder(stage: int, ranks: int, schedule: str = "1f1b") -> int:
    """The pipeline rank that runs `stage`: virtual stages loop (stage s on rank s mod ranks), or under a V-shaped
    schedule go down and back (s on rank s for s < ranks, else 2 ranks - 1 - s), as torch's schedules place them."""
    if schedule in V_SCHEDULES and stage >= ranks:
        return 2 * ranks - 1 - stage
    return stage % ranks


def stages_of(rank: int, ranks: int, stages: int, schedule: str = "1f1b") -> list[int]:
    """The stages pipeline rank `rank` runs, in stage order."""
    return [s for s in range(stages) if holder(s, ranks, schedule) == rank]


def check_stages_per_rank(p) -> None:
    """`parallel.pipeline_stages_per_rank` against the schedule: one line naming what it takes."""
    v, schedule = p.pipeline_stages_per_rank, p.pipeline_schedule
    if v and p.pipeline <= 1:
        raise ConfigError(f"parallel.pipeline_stages_per_rank = {v} needs parallel.pipeline > 1; set "
                          "parallel.pipeline or remove parallel.pipeline_stages_per_rank")
    fixed = 2 if schedule in V_SCHEDULES else 1 if schedule not in VIRTUAL_SCHEDULES else 0
    if fixed and v not in (0, fixed):
        raise ConfigError(f"parallel.pipeline_stages_per_rank = {v}: parallel.pipeline_schedule = {schedule!r} runs "
                          f"{fixed} a rank; give {fixed} or 0, or choose interleaved-1f1b or zero-bubble for more")
    if not fixed and (v < 0 or v == 1):
        raise ConfigError(f"parallel.pipeline_stages_per_rank = {v}: parallel.pipeline_schedule = {schedule!r} runs 2 "
                          "or more a rank; give 2 or more, or 0 (2)")


VIRTUAL_SCHEDULES = ("interleaved-1f1b", "zero-bubble", "zbv", "dualpipev")
"""Schedules that put two (virtual) stages on each pipeline rank, or more (`parallel.pipeline_stages_per_rank`) for
the looped ones."""
V_SCHEDULES = ("zbv", "dualpipev")
"""Of those, the V-shaped: rank r runs stages r and 2p - 1 - r (the first and the last stage on rank 0), where the
others loop (stages r and r + p)."""
SPLIT_BACKWARD_SCHEDULES = ("zero-bubble", *V_SCHEDULES)
"""Schedules that split each backward into an input and a weight part (torch's zero-bubble family)."""


def _micro_for(global_batch: int, data: int, microbatches: int) -> str:
    size, rest = divmod(global_batch, data * microbatches)
    return str(size) if size and not rest else f"global_batch_size / ({data} x {microbatches}) (not a whole number now)"


def device_mesh(layout: MeshLayout, device_type: str):
    """torch's DeviceMesh over every rank, with the axes `MESH_AXES` (size-1 axes included; `cp` folded into the data
    axis, `MeshLayout.mesh_shape`)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, layout.mesh_shape, mesh_dim_names=MESH_AXES)


def context_groups(layout: MeshLayout):
    """This rank's process group of the `cp` axis (the ranks that hold the pieces of the same sequences); every
    rank creates every group, in the same order, as torch requires."""
    import itertools

    import torch.distributed as dist

    mine, rank = None, dist.get_rank()
    outer = [range(n) for n in layout.shape[:3]]
    for pp, dpr, dps, tp in itertools.product(*outer, range(layout.tensor)):
        ranks = [(((pp * layout.replicate + dpr) * layout.shard + dps) * layout.context + cp) * layout.tensor + tp
                 for cp in range(layout.context)]
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine
