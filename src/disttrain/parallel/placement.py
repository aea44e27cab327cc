"""Where a model's parameters live under a pipeline x tensor layout, by name, for the memory estimator: which
parameters a pipeline rank holds (its stage's blocks, the embeddings on the first stage, the final norm and head on
the last; a tied embedding/head weight on both) and the local shape of each under tensor parallelism (the split
parallel/tensor.py applies: column-wise linears by output rows, row-wise by input columns with their bias whole,
the embedding by vocabulary rows, the head by vocabulary columns, i.e. its weight's rows; the rest whole).

It reads a model built on the meta device (no memory) and the same split rules the strategies apply
(stages.split_points, tensor.FAMILIES), so the estimate follows what a real run holds.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import TYPE_CHECKING

from torch import nn

from disttrain.parallel import tensor
from disttrain.parallel.activation_checkpoint import transformer_blocks
from disttrain.parallel.mesh import VIRTUAL_SCHEDULES, MeshLayout, stage_count, stages_of
from disttrain.parallel.stages import FAMILIES, family_of, schedule_class, stage_bounds

if TYPE_CHECKING:
    from disttrain.config import ParallelConfig

Shape = tuple[int, ...]


def rank_stages(layout: MeshLayout, parallel: ParallelConfig, pipeline_rank: int) -> list[int]:
    """The stages a pipeline rank runs, as the pipeline places them."""
    return stages_of(pipeline_rank, layout.pipeline, stage_count(parallel, layout.pipeline), parallel.pipeline_schedule)


def stage_parameters(model: nn.Module, layout: MeshLayout, parallel: ParallelConfig,
                     pipeline_rank: int, trainable: bool = True) -> list[tuple[str, nn.Parameter]]:
    """(first name, parameter) of every trainable (or, `trainable=False`, frozen) parameter the pipeline rank holds,
    each once."""
    if layout.pipeline == 1:
        return [(n, p) for n, p in model.named_parameters() if p.requires_grad == trainable]
    fam = FAMILIES[family_of(model)]
    stages = stage_count(parallel, layout.pipeline)
    bounds = stage_bounds(model, stages, parallel.pipeline_split)
    blocks = transformer_blocks(model)
    mine = rank_stages(layout, parallel, pipeline_rank)
    modules = [blocks[i] for s in mine for i in range(*bounds[s])]
    if 0 in mine:
        modules += [model.get_submodule(name) for name in fam.embeddings]
    if stages - 1 in mine:
        modules += [model.get_submodule(name) for name in fam.head]
    kept = {id(p) for module in modules for p in module.parameters()}
    held = [(n, p) for n, p in model.named_parameters() if id(p) in kept and p.requires_grad == trainable]
    if layout.data > 1 and 0 in mine and stages - 1 in mine:  # a V's rank 0: the head's own copy of a tied weight
        head = tuple(f"{name}." for name in fam.head)
        names, ids = {n for n, _ in held}, {id(p) for _, p in held}
        held += [(n, p) for n, p in model.named_parameters(remove_duplicate=False)
                 if n.startswith(head) and n not in names and id(p) in ids]
    return held


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


def local_shapes(model: nn.Module, layout: MeshLayout, parallel: ParallelConfig, pipeline_rank: int,
                 trainable: bool = True) -> list[Shape]:
    """Shapes of the trainable (or frozen) parameters one rank holds under `layout` before the data axis shards
    them: its pipeline stage(s), each tensor-parallel shard's local part (all tensor ranks hold the same shapes)."""
    params = stage_parameters(model, layout, parallel, pipeline_rank, trainable)
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


def in_flight(schedule: str, ranks: int, pipeline_rank: int, microbatches: int,
              sizes: tuple[float, ...] = (1.0, 1.0)) -> tuple[list[int], bool]:
    """The micro-batches whose activations a pipeline rank holds at its peak, as the local stage each belongs to
    (0: its first stage; 1: its second under the schedules with several stages per rank, ...), in forward order.
    `sizes`: the bytes one micro-batch of each local stage holds, one per stage the rank runs (the peak is the most
    bytes, not the most micro-batches).
    Also whether the count follows the schedule's own order (False: an approximation, see below).

    gpipe           every forward before any backward: all m micro-batches of its stage.
    1f1b            p - 1 - r warm-up forwards, then one forward and one backward in turn: min(p - r, m).
    the others      (interleaved-1f1b, zero-bubble, zbv, dualpipev) the order of forwards and backwards torch's
                    schedule class computes for this rank (`torch_order`), played through: a micro-batch's
                    activations live from its forward to its full backward or, where the backward is split into an
                    input and a weight part, to the weight part (the input part keeps the graph for it).
                    Without torch's order (a torch that computes it elsewhere): interleaved-1f1b's count, for all."""
    p, r, m = ranks, pipeline_rank, microbatches
    if schedule == "gpipe":
        return [0] * m, True
    if schedule == "1f1b":
        return [0] * min(p - r, m), True
    v = len(sizes)
    order = torch_order(schedule, p, r, m, v)
    if order is None:
        per_round = m // max(1, m // p)
        chunks = min((v - 1) * per_round + 2 * (p - 1 - r) + 1, v * m)  # (torch's warm-up forwards, and one)
        return [(i // per_round) % v for i in range(chunks)], False
    local = {stage: i for i, stage in enumerate(stages_of(r, p, v * p, schedule))}
    held, peak = [], []
    for stage, kind in order:
        if kind == "F":
            held.append(local[stage])
        elif kind in ("B", "W"):
            held.remove(local[stage])  # one of that stage's micro-batches (they are the same size)
        if sum(sizes[c] for c in held) > sum(sizes[c] for c in peak):
            peak = list(held)
    return peak, True


def torch_order(schedule: str, ranks: int, rank: int, microbatches: int, stages_per_rank: int = 2
                ) -> list[tuple[int, str]] | None:
    """[(stage, F | B | I | W)]: the computations pipeline rank `rank` runs in a step, in the order the
    torch.distributed.pipelining class that runs `schedule` (stages.schedule_class) computes for it (forward,
    full backward, input backward, weight backward; an overlapped forward-backward pair as its two parts, in the
    order the runtime runs them). From the class's own `_calculate_single_rank_operations`, given what it reads
    (no stages or process group needed); None for the one-stage classes, or where this torch has no such method."""
    if schedule not in VIRTUAL_SCHEDULES:
        return None
    from torch.distributed import pipelining

    rounds = max(1, microbatches // ranks)
    v = stages_per_rank
    state = SimpleNamespace(pp_group_size=ranks, _n_microbatches=microbatches, n_local_stages=v,
                            _stages=[None] * v, num_stages=v * ranks, _num_stages=v * ranks, rank=rank,
                            number_of_rounds=rounds, microbatches_per_round=microbatches // rounds)
    try:  # a private method (the order is torch's to keep; a copy of it here would drift from the torch installed)
        cls = getattr(pipelining, schedule_class(schedule, microbatches, ranks))
        actions = cls._calculate_single_rank_operations(state, rank)
        return [(part.stage_index, _KINDS[part.computation_type.name])
                for action in filter(None, actions) for part in action.sub_actions or (action,)]
    except Exception:  # a torch that computes it elsewhere, or reads more than it did: the caller approximates
        return None


_KINDS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
