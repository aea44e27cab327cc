"""What a pipeline stage holds and runs (pure model surgery, no process group): the model families disttrain splits
(how each embeds, runs a block and finishes), where the stages split (balanced by parameters, or
`parallel.pipeline_split`), which pipeline rank holds which stage under each schedule, which torch class runs the
schedule (`schedule_class`), and the stage's module (`StagePart`) with the rest of the model pruned to placeholders.
pipeline.py runs them with `torch.distributed.pipelining`; the memory estimator (placement.py, activations.py) reads
the same split.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from disttrain.errors import ConfigError
from disttrain.parallel.activation_checkpoint import transformer_blocks
from disttrain.parallel.mesh import V_SCHEDULES, VIRTUAL_SCHEDULES

log = logging.getLogger(__name__)

SEQUENCE_SHARDS = "disttrain_sequence_shards"
"""Attribute `tensor.parallelize` sets on the model and each of its blocks: the shares the stream between them comes
in (the tensor degree under sequence parallelism, else 1; a Llama's first block takes the whole sequence and splits
it). The pipeline sends a stage's share (parallel/pipeline.py), and a stage's Llama block computes the rotary
positions of the whole sequence from its share (`_llama_block` below)."""

# ----------------------------------------------------------------------------------------------
# What a stage runs, per model family


@dataclass
class Family:
    """How the model turns token ids into the residual stream, runs one block, and turns the stream into logits."""

    embeddings: tuple[str, ...]
    """Modules that only the first stage keeps."""
    head: tuple[str, ...]
    """Modules that only the last stage keeps."""
    embed: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    block: Callable[[nn.Module, nn.Module, torch.Tensor], torch.Tensor]
    """block(model, block, x): run one block (a Llama layer needs the rotary embedding of the positions)."""
    finish: Callable[[nn.Module, torch.Tensor], torch.Tensor]


POSITIONS = "_disttrain_positions"
"""Set on a model whose sequences are cut across ranks (context parallelism): `positions(width, device)`, the
positions of the `width` tokens of a sequence this rank holds (pipeline.py)."""


def positions(model: nn.Module, width: int, device) -> torch.Tensor:
    """The positions of the `width` tokens a stage gets of each sequence: 0, 1, 2, ..., or under context parallelism
    the rank's pieces' (`POSITIONS`)."""
    held = getattr(model, POSITIONS, None)
    return held(width, device) if held is not None else torch.arange(width, device=device)


def _gpt_embed(model, ids):
    return model.drop(model.tok_emb(ids) + model.pos_emb(positions(model, ids.shape[1], ids.device)))


def _llama_block(model, block, x):
    # under sequence parallelism a block after the first gets its rank's share of the sequence, while its attention
    # runs on the whole (gathered on entry): the rotary embedding of every position
    where = positions(model, x.shape[1] * getattr(block, SEQUENCE_SHARDS, 1), x.device)[None]
    rotary = model.model.rotary_emb(x, where)
    return block(x, attention_mask=None, position_ids=where, position_embeddings=rotary)


FAMILIES = {
    "gpt": Family(("tok_emb", "pos_emb", "drop"), ("ln_f", "lm_head"), _gpt_embed,
                  lambda model, block, x: block(x), lambda model, x: model.lm_head(model.ln_f(x))),
    "llama": Family(("model.embed_tokens",), ("model.norm", "lm_head"),
                    lambda model, ids: model.model.embed_tokens(ids), _llama_block,
                    lambda model, x: model.lm_head(model.model.norm(x))),
}


def family_of(model: nn.Module) -> str:
    names = {name for name, _ in model.named_modules()}
    for name, fam in FAMILIES.items():
        if set(fam.embeddings) | set(fam.head) <= names:
            return name
    raise ConfigError(f"parallel.pipeline > 1: disttrain cannot split {type(model).__name__} into stages (it splits "
                      "the reference GPT and Hugging Face Llama-family models); set parallel.pipeline = 1")


# ----------------------------------------------------------------------------------------------
# Where the stages split (pure)


def balanced_split(block_sizes: list[int], stages: int, first_extra: int = 0, last_extra: int = 0) -> list[int]:
    """Index of the first block of each stage after the first: consecutive blocks, each stage at least one,
    minimising the largest stage's parameters (the embedding counts on the first stage, the head on the last); of
    the splits that do, the one whose cuts come earliest. The least largest stage of every suffix is tabled first
    (stages x blocks^2 steps: an 80-block model into 8 stages at once), then each cut is the earliest that keeps it."""
    n = len(block_sizes)
    if n < stages:
        raise ConfigError(f"the model's {n} blocks cannot fill {stages} pipeline stages (parallel.pipeline x its "
                          "stages a rank, parallel.pipeline_stages_per_rank or the schedule's); use fewer stages")
    ends = [0]
    for size in block_sizes:
        ends.append(ends[-1] + size)

    def load(start: int, end: int, stage: int) -> int:
        return (ends[end] - ends[start] + (first_extra if stage == 0 else 0)
                + (last_extra if stage == stages - 1 else 0))

    @functools.cache
    def least(start: int, stage: int) -> int:
        """The least largest stage of blocks[start:] over stages stage..stages-1."""
        if stage == stages - 1:
            return load(start, n, stage)
        return min(max(load(start, end, stage), least(end, stage + 1))
                   for end in range(start + 1, n - (stages - 1 - stage) + 1))

    best, cuts, start = least(0, 0), [], 0
    for stage in range(stages - 1):
        start = next(end for end in range(start + 1, n - (stages - 1 - stage) + 1)
                     if max(load(start, end, stage), least(end, stage + 1)) <= best)
        cuts.append(start)
    return cuts


def split_points(model: nn.Module, stages: int, given: str) -> list[int]:
    """First block index of stages 2..N: `parallel.pipeline_split` ("blocks.3,blocks.6" or layer numbers) or
    balanced by parameter count."""
    blocks = transformer_blocks(model)
    if given.strip():
        names = {id(b): i for i, b in enumerate(blocks)}
        index = {name: names[id(m)] for name, m in model.named_modules() if id(m) in names}
        cuts = []
        for item in (s.strip() for s in given.split(",")):
            if item not in index:
                raise ConfigError(f"parallel.pipeline_split = {given!r}: {item!r} is not a block of the model; give "
                                  f"block names such as {next(iter(index))!r}")
            cuts.append(index[item])
        if len(cuts) != stages - 1 or cuts != sorted(set(cuts)) or cuts[0] == 0:
            raise ConfigError(f"parallel.pipeline_split = {given!r}: give {stages - 1} increasing block names after "
                              f"the first block (where stages 2..{stages} begin)")
        return cuts
    fam = FAMILIES[family_of(model)]
    size = lambda names: sum(p.numel() for n in names for p in model.get_submodule(n).parameters())  # noqa: E731
    return balanced_split([sum(p.numel() for p in b.parameters()) for b in blocks], stages, size(fam.embeddings),
                          size(fam.head))


def stage_bounds(model: nn.Module, stages: int, given: str, warn: bool = False) -> list[tuple[int, int]]:
    """[first block, end) of each stage (`split_points`); `warn`: log `uneven_stages`'s line where the balanced split
    leaves the inner stages uneven (a split given is the user's choice)."""
    cuts = split_points(model, stages, given) if stages > 1 else []
    bounds = list(zip([0, *cuts], [*cuts, len(transformer_blocks(model))], strict=True))
    if warn and not given.strip() and uneven_stages(bounds):
        log.warning("%s", uneven_stages(bounds))
    return bounds


def uneven_stages(bounds: list[tuple[int, int]]) -> str:
    """One line where the stages between the first and the last (which hold the embeddings and the head besides
    their blocks) hold unequal block counts: each round of the schedule moves at its heaviest stage's pace, so the
    lighter ones wait (126 blocks in 112 stages leave 14 of them twice as long). '' where they are even."""
    inner = [high - low for low, high in bounds[1:-1]]
    if len(set(inner)) < 2:
        return ""
    return (f"the {len(bounds)} pipeline stages (parallel.pipeline x its stages per rank) hold {bounds[-1][1]} blocks "
            f"unevenly: those between the first and the last hold {min(inner)} to {max(inner)} each, and a round of "
            "the schedule moves at its heaviest stage's pace; choose a stage count that divides the blocks evenly, "
            "or set parallel.pipeline_split")


# ----------------------------------------------------------------------------------------------
# Building the stages


class Placeholder(nn.Module):
    """Where another stage's block was: no parameters, so names and indices stay the full model's."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipeline stage ran a block that belongs to another stage")


class StagePart(nn.Module):
    """One stage: the embedding (first stage), its blocks, the final norm and head (last stage) of the model, as
    submodules (the same parameters as the pruned model's). What a `PipelineStage` runs, and what data parallelism
    wraps (its own FSDP root: the model's forward is never called under a pipeline)."""

    def __init__(self, model: nn.Module, fam: Family, bounds: tuple[int, int], first: bool, last: bool):
        super().__init__()
        self.fam, self.first, self.last = fam, first, last
        self.blocks = nn.ModuleList(transformer_blocks(model)[bounds[0]:bounds[1]])
        self.ends = nn.ModuleDict({name.replace(".", "_"): model.get_submodule(name) for name in
                                   [*(fam.embeddings if first else ()), *(fam.head if last else ())]})
        self._model = [model]  # not a submodule: the pruned model, for the family's functions

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        model = self._model[0]
        if self.first:
            x = self.fam.embed(model, x)
        for block in self.blocks:
            x = self.fam.block(model, block, x)
        return self.fam.finish(model, x) if self.last else x


def prune(model: nn.Module, fam: Family, keep: list[tuple[int, int]], first: bool, last: bool) -> None:
    """Leave in `model` only what this rank runs: the blocks in `keep`'s ranges (others become placeholders), the
    embedding if it holds the first stage, the head if the last (a tied weight stays with the module kept)."""
    block_list = _block_list(model)
    for i in range(len(block_list)):
        if not any(lo <= i < hi for lo, hi in keep):
            block_list[i] = Placeholder()
    for names, kept in ((fam.embeddings, first), (fam.head, last)):
        for name in names if not kept else ():
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, None)


def _block_list(model: nn.Module) -> nn.ModuleList:
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return max(lists, key=len)


SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B",
             "zero-bubble": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
             "dualpipev": "ScheduleDualPipeV"}


def schedule_class(schedule: str, microbatches: int, ranks: int) -> str:
    """The name of the torch.distributed.pipelining class that runs `schedule` for a step of `microbatches`."""
    # too few micro-batches to interleave (e.g. one call of the TrainingService): all forwards, then all backwards,
    # the same numbers (torch's V-shaped schedule drops the micro-batches it lacks itself; no other has its placement)
    if microbatches < ranks and schedule not in V_SCHEDULES:
        return "ScheduleLoopedBFS" if schedule in VIRTUAL_SCHEDULES else "ScheduleGPipe"
    if microbatches < 2 * ranks and schedule == "dualpipev":  # DualPipeV needs one per stage: zbv, same V
        return "ScheduleZBVZeroBubble"
    return SCHEDULES[schedule]
