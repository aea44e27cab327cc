"""Where a model's parameters live under a pipeline x tensor layout, by name, for the memory estimator: which
parameters a pipeline rank holds (its stage's blocks, the embeddings on the first stage, the final norm and head on
the last; a tied embedding/head weight on both) and the local shape of each under tensor parallelism (the split
parallel/tensor.py applies: column-wise linears by output rows, row-wise by input columns with their bias whole,
the embedding by vocabulary rows, the head by vocabulary columns, i.e. its weight's rows; the rest whole).

It reads a model built on the meta device (no memory) and the same split rules the strategies apply
(pipeline.split_points, tensor.FAMILIES), so the estimate follows what a real run holds.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from torch import nn

from disttrain.parallel import pipeline, tensor
from disttrain.parallel.activation_checkpoint import transformer_blocks
from disttrain.parallel.mesh import V_SCHEDULES, MeshLayout

if TYPE_CHECKING:
    from disttrain.config import ParallelConfig

Shape = tuple[int, ...]


def rank_stages(layout: MeshLayout, parallel: ParallelConfig, pipeline_rank: int) -> list[int]:
    """The stages a pipeline rank runs, as the pipeline places them."""
    return pipeline.stages_of(pipeline_rank, layout.pipeline, pipeline.stage_count(parallel, layout.pipeline),
                              parallel.pipeline_schedule)


def stage_parameters(model: nn.Module, layout: MeshLayout, parallel: ParallelConfig,
                     pipeline_rank: int) -> list[tuple[str, nn.Parameter]]:
    """(first name, parameter) of every trainable parameter the pipeline rank holds, each once."""
    if layout.pipeline == 1:
        return [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    fam = pipeline.FAMILIES[pipeline.family_of(model)]
    stages = pipeline.stage_count(parallel, layout.pipeline)
    bounds = pipeline.stage_bounds(model, stages, parallel.pipeline_split)
    blocks = transformer_blocks(model)
    mine = rank_stages(layout, parallel, pipeline_rank)
    modules = [blocks[i] for s in mine for i in range(*bounds[s])]
    if 0 in mine:
        modules += [model.get_submodule(name) for name in fam.embeddings]
    if stages - 1 in mine:
        modules += [model.get_submodule(name) for name in fam.head]
    kept = {id(p) for module in modules for p in module.parameters()}
    return [(n, p) for n, p in model.named_parameters() if id(p) in kept and p.requires_grad]


def tensor_shard_shape(shape: Shape, degree: int, dim: int | None) -> Shape:
    """The local shape on one of `degree` tensor-parallel ranks of a parameter split along `dim` (None: whole)."""
    if degree == 1 or dim is None or not shape:
        return shape
    return tuple(math.ceil(n / degree) if i == dim else n for i, n in enumerate(shape))


def tensor_splits(model: nn.Module) -> dict[str, int]:
    """Parameter name (every name of a tied one) -> the dimension tensor parallelism splits, from the family's
    plan: column-wise linears' weight and bias by rows (0), row-wise linears' weight by columns (1; the bias
    stays whole), the input embedding by vocabulary rows and the head by vocabulary (its weight's rows)."""
    plan = tensor.FAMILIES[tensor.family(model)]
    names = {module: name for name, module in model.named_modules()}
    out = {}
    for block in transformer_blocks(model):
        prefix = names[block] + "."
        for column in plan["column"]:
            out.update({prefix + column + ".weight": 0, prefix + column + ".bias": 0})
        for row in plan["row"]:
            out[prefix + row + ".weight"] = 1
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else model.tok_emb
    out[names[embedding] + ".weight"] = 0
    out.update({"lm_head.weight": 0, "lm_head.bias": 0})
    return out


def local_shapes(model: nn.Module, layout: MeshLayout, parallel: ParallelConfig, pipeline_rank: int) -> list[Shape]:
    """Shapes of the parameters one rank holds under `layout` before the data axis shards them: its pipeline
    stage(s), each tensor-parallel shard's local part (all tensor ranks hold the same shapes)."""
    params = stage_parameters(model, layout, parallel, pipeline_rank)
    splits = tensor_splits(model) if layout.tensor > 1 else {}
    # a tied weight is split as any of its names is (embedding and head agree)
    aliases = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    out = []
    for _, p in params:
        dim = next((splits[n] for n in aliases[id(p)] if n in splits), None)
        out.append(tensor_shard_shape(tuple(p.shape), layout.tensor, dim))
    return out


def in_flight(schedule: str, ranks: int, pipeline_rank: int, microbatches: int) -> list[int]:
    """The micro-batches whose activations a pipeline rank holds at its peak, as the local stage each belongs to
    (0: its first stage; 1: its second under the interleaved schedules), in forward order.

    gpipe           every forward before any backward: all m micro-batches of its stage.
    1f1b            p - 1 - r warm-up forwards, then one forward and one backward in turn: min(p - r, m).
    interleaved     torch's ScheduleInterleaved1F1B: (v - 1) x k + 2 (p - 1 - r) warm-up forwards (k = micro-batches
    (and            per round, m / (m // p)), then one forward and one backward in turn, so that many + 1 chunks,
    zero-bubble)    capped at v x m; forwards run in rounds of k micro-batches per local stage (k of the first,
                    k of the second, ...). Zero-bubble splits each backward into an input and a weight part whose
                    saved tensors live until the weight part runs: counted as interleaved (measured at 0.9x-1.9x
                    this: docs/benchmarks/memory_schedules.md).
    zbv             torch's ScheduleZBVZeroBubble, whose order `_zbv_order` follows: a micro-batch's activations
                    live from its forward to its weight backward; at most 2p chunks, the 1f1b peak of rank 0 in
                    half-size stages (measured at 1.25x-1.3x this).
    dualpipev       counted as zbv (the same V placement; DualPipeV's overlapped forward and backward pairs are not
                    modelled; measured at 1.25x-1.4x this)."""
    p, r, m = ranks, pipeline_rank, microbatches
    if schedule == "gpipe":
        return [0] * m
    if schedule == "1f1b":
        return [0] * min(p - r, m)
    if schedule in V_SCHEDULES:
        held, peak = [], []
        for stage, forward in _zbv_order(p, r, m):
            if forward:
                held.append(stage)
            else:
                held.remove(stage)  # the oldest of that stage's micro-batches
            if len(held) > len(peak):
                peak = list(held)
        return list(peak)
    local = 2
    per_round = m // max(1, m // p)
    chunks = min((local - 1) * per_round + 2 * (p - 1 - r) + 1, local * m)
    return [(i // per_round) % local for i in range(chunks)]


def _zbv_order(p: int, r: int, m: int) -> list[tuple[int, bool]]:
    """(local stage, True: a forward / False: a weight backward) of pipeline rank r, in torch's ScheduleZBVZeroBubble
    order for p ranks and m micro-batches: 2(p - r) - 1 forwards of its first stage, r pairs of forwards (second,
    first), p - r rounds of forward and backward of its second stage, then one and the other in turn until every
    micro-batch is through, then the weight backwards left; torch schedules max(m, 2p - 1) micro-batches and drops
    those past m."""
    n = max(2 * p - 1, m)
    issued, order = [0, 0, 0, 0], []  # forwards of stage 0 and 1, weight backwards of stage 0 and 1

    def act(stage: int, forward: bool) -> None:
        slot = stage + (0 if forward else 2)
        if issued[slot] < m:
            order.append((stage, forward))
        issued[slot] += 1

    for _ in range(2 * (p - r) - 1):
        act(0, True)
    for _ in range(r):
        act(1, True)
        act(0, True)
    for _ in range(p - r):
        act(1, True)
        act(1, False)
    while issued[1] < issued[0] or issued[0] < n:
        if issued[0] < n:
            act(0, True)
        act(0, False)
        act(1, True)
        act(1, False)
    for _ in range(p - r):  # the cool-down's weight backwards: p - r of the first stage, the rest of the second,
        act(0, False)  # then of the first
    for stage in (1, 0):
        while issued[stage + 2] < issued[stage]:
            act(stage, False)
    return order
