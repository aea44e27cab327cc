"""Pipeline parallelism with `torch.distributed.pipelining`: the model's blocks are split into consecutive stages,
one (or two, for the interleaved, zero-bubble and V-shaped schedules) per rank of the mesh's `pp` axis, and a
schedule runs the forward and backward of all micro-batches of a step through them.

Each rank keeps the *whole model object* with the other stages' blocks replaced by parameterless placeholders and
the embedding / head removed where they do not run, so parameter names (state dicts, checkpoints, optimizer groups)
are the full model's; the model's `forward` is replaced by the stage's (embed on the first stage, its blocks, the
final norm and head on the last). Data parallelism (FSDP2 or replication over the data axes) and tensor
parallelism then apply to that stage model as to any model.

The loss is the backend's: each micro-batch's `loss_terms` (a token sum and count) runs on the last stage inside
the schedule (`scale_grads=False`, so gradients stay sums), and the step's sum and count reach the backend once,
through the last micro-batch's `on_loss`; other stages report zeros and do not count (parallel/compose.py). Tied
embedding and head weights, which live on the first and last stage, get their two gradients summed before the step
(under a V-shaped schedule both stages run on rank 0, where the weight is one parameter; with a data axis, where each
stage is its own data-parallel root, the head holds a copy that follows the embedding: `pipeline_state.untie_head`).
Evaluation runs the stages forward one after another with point-to-point sends (no schedule, any batch size).
Under context parallelism the step's micro-batches come whole and are cut into the rank's pieces at the step's widest
width (`Prepared.cuts_context`): the schedule's one shape, and the positions each stage computes from it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from disttrain.errors import ConfigError
from disttrain.parallel.mesh import VIRTUAL_SCHEDULES, holder, stage_count, stages_of
from disttrain.parallel.pipeline_state import local_state_fns, tie_pairs, untie_head
from disttrain.parallel.spec import Prepared
from disttrain.parallel.stages import (
    FAMILIES,
    SEQUENCE_SHARDS,
    StagePart,
    family_of,
    prune,
    schedule_class,
    stage_bounds,
)
from disttrain.parallel.state import local_tensor, tie_groups

KEPT_SCHEDULES = 4
"""Schedules (with their stages' device buffers) kept for the step shapes seen last (`PipelinePrepared._schedule`)."""


# ----------------------------------------------------------------------------------------------
# The strategy's Prepared


@dataclass
class Pending:
    ids: torch.Tensor
    loss_terms: Callable


@dataclass
class PipelinePrepared(Prepared):
    """This rank's stage(s) and the schedule; `forward_backward` collects a step's micro-batches and runs the
    schedule over them on the step's last one."""

    parts: list = field(default_factory=list)
    """[(stage index, StagePart or its data-parallel wrapper)] on this rank, in stage order."""
    layout: Any = None
    """(number of stages, pipeline ranks, this rank's index, its process group, schedule name, hidden size, the
    residual stream's dtype)."""
    twins: list = field(default_factory=list)
    """[(embedding, head)]: a tied weight whose first and last stage share this rank under a data axis, held as two
    parameters (`pipeline_state.untie_head`) whose gradients are summed before the step."""
    tie_pairs: list = field(default_factory=list)
    """[(parameter, process group)]: tied weights (first and last stage) whose gradients are summed before the step."""
    pending: list = field(default_factory=list)
    schedules: dict = field(default_factory=dict)
    """(micro-batches, micro-batch size, width) -> schedule (static shapes: nothing but tensors on the wire)."""

    def forward_backward(self, inputs, loss_terms, on_loss, sync, autocast):
        if self.context is None:  # (under context parallelism the backend checked the whole batch: cut below)
            check_mask(inputs.kwargs)
        ids_now = _ids_of(inputs)
        self.pending.append(Pending(ids_now, loss_terms))
        # on the batch's device: a stage without the head hands these to fp16's scaler, which would otherwise keep
        # its scale on the host, away from the last stage's (and read a non-blocking copy of found_inf unsynced)
        zero = torch.zeros((), dtype=torch.float64, device=ids_now.device)
        if not sync:
            return zero, zero  # counted when the schedule runs, on the step's last micro-batch
        pending, self.pending = self.pending, []
        if len({p.ids.shape[0] for p in pending}) > 1:
            sizes = [p.ids.shape[0] for p in pending]
            raise ConfigError(f"parallel.pipeline > 1: the micro-batches of a step have {sizes} rows; a pipeline "
                              "needs equal micro-batches: make the batch a multiple of the micro-batch size times the "
                              "data-parallel degree")
        totals = [zero, zero]
        widths = [p.ids.shape[1] for p in pending]
        cut = None
        if self.context is not None:  # each micro-batch cut into pieces at the step's widest: one shape, and every
            cut = functools.partial(self.context.shard, width=self.context.padded(max(widths)), check=False)
            ids = torch.cat([cut({"input_ids": p.ids})["input_ids"] for p in pending])  # (the stages' positions)
            widths = [ids.shape[1]] * len(pending)
        else:
            ids = _pad_cat([p.ids for p in pending], self.layout.shards)
        scale = self.scaler.get_scale() if self.scaler is not None else 1.0

        def loss_fn(output: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
            i = int(index.reshape(-1)[0])
            loss_sum, count = pending[i].loss_terms(output[:, :widths[i]], cut)
            totals[0] = totals[0] + loss_sum.detach().double()
            totals[1] = totals[1] + count
            return loss_sum * scale if scale != 1.0 else loss_sum

        schedule = self._schedule(len(pending), pending[0].ids.shape[0], ids.shape[1], ids.device)
        schedule._loss_fn = loss_fn  # this step's micro-batches (the target is their index)
        target = torch.arange(len(pending))  # on the host: reading a micro-batch's index never waits for the device
        with autocast:
            schedule.step(*((ids,) if self.layout.rank == 0 else ()), target=target, return_outputs=False)
        on_loss(totals[0], totals[1])  # the step's totals, once (zeros on stages without the head)
        return totals[0], totals[1]

    def _schedule(self, microbatches: int, size: int, width: int, device):
        """The schedule of these shapes, built once. Each holds its stages' receive buffers on the device, so only
        the last `KEPT_SCHEDULES` are kept: batches padded to their longest row change width from step to step."""
        key = (microbatches, size, width)
        schedule = self.schedules.pop(key, None) or build_schedule(self, microbatches, size, width, device)
        self.schedules[key] = schedule  # the most recent last
        while len(self.schedules) > KEPT_SCHEDULES:
            del self.schedules[next(iter(self.schedules))]
        return schedule

    def step(self, factor: float, skip: bool = False, need_norm: bool = True) -> tuple[float, bool]:
        for embedding, head in self.twins:  # one weight: both copies step with the sum of their gradients
            if embedding.grad is None or head.grad is None:
                source = embedding.grad if embedding.grad is not None else head.grad
                if source is not None:  # only one copy was used in this step
                    embedding.grad, head.grad = source, source.clone()
                continue
            total, other = local_tensor(embedding.grad), local_tensor(head.grad)
            total.add_(other)
            other.copy_(total)
        for param, group in self.tie_pairs:
            grad = param.grad
            if grad is None and not param.requires_grad:
                continue  # (a frozen weight: frozen on both stages, so neither joins)
            if grad is None:  # this copy got no gradient in this step: it joins the sum all the same (its twin's rank
                grad = param.grad = torch.zeros_like(param)  # is in it) and steps with the twin's gradient
            if hasattr(grad, "placements") and grad.placements != param.placements:  # e.g. an embedding's
                grad = param.grad = grad.redistribute(placements=param.placements)  # gradient left replicated
            dist.all_reduce(local_tensor(grad), group=group)
        result = super().step(factor, skip, need_norm)
        with torch.no_grad():  # the head follows the embedding, whatever an optimizer's groups did by name
            for embedding, head in self.twins:
                local_tensor(head).copy_(local_tensor(embedding))
        return result


@dataclass(frozen=True)
class StageLayout:
    stages: int
    ranks: int
    rank: int
    group: Any
    schedule: str
    hidden: int
    vocab: int
    dtype: Any
    """The residual stream's dtype between stages."""
    shards: int = 1
    """Tensor ranks the stream is split over along the sequence (sequence parallelism: each sends its share)."""

    def holder(self, stage: int) -> int:
        return holder(stage, self.ranks, self.schedule)


def build_schedule(prepared: PipelinePrepared, microbatches: int, size: int, width: int, device):
    from torch.distributed import pipelining

    lay = prepared.layout
    stages = []
    for index, part in prepared.parts:
        stream = (size, width // lay.shards, lay.hidden)  # (the logits are whole: the head gathers the sequence)
        meta = torch.empty((size, width), dtype=torch.long, device="meta") if index == 0 else \
            torch.empty(stream, dtype=lay.dtype, device="meta", requires_grad=True)
        out = torch.empty(stream if index < lay.stages - 1 else (size, width, lay.vocab), dtype=lay.dtype,
                          device="meta", requires_grad=True)  # (requires_grad: gradients flow back through it)
        # every shape given: the stages never exchange (pickled) metadata
        stages.append(pipelining.PipelineStage(part, index, lay.stages, device, input_args=(meta,),
                                               output_args=(out,), group=lay.group))
    one = lay.schedule not in VIRTUAL_SCHEDULES
    name = schedule_class(lay.schedule, microbatches, lay.ranks)
    return getattr(pipelining, name)(stages[0] if one else stages, n_microbatches=microbatches,
                                     loss_fn=lambda output, target: output, scale_grads=False)


def _ids_of(inputs) -> torch.Tensor:
    ids = inputs.args[0] if inputs.args else (inputs.kwargs or {}).get("input_ids")
    if not isinstance(ids, torch.Tensor):
        raise ConfigError("parallel.pipeline > 1 feeds the first stage token ids only: give batches with "
                          "'input_ids' (and 'labels')")
    return ids


def check_mask(kwargs, setting: str = "parallel.pipeline") -> None:
    """Under a pipeline only token ids cross the stages, and under context parallelism each piece attends causally
    over the whole sequence: both attend causally from position 0 with no mask. Padding on the right changes nothing
    before it, but an attention mask that hides a token before a real one (left padding) or positions that restart
    inside a row (packed sequences) would be ignored, so such a batch is refused rather than trained on wrongly.
    (One host sync per micro-batch that carries either key.)"""
    kwargs = kwargs or {}
    mask, positions = kwargs.get("attention_mask"), kwargs.get("position_ids")
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2
                             or bool((mask[:, 1:].int() > mask[:, :-1].int()).any())):
        raise ConfigError(f"{setting} > 1 attends causally without the attention mask, and this batch's "
                          "attention_mask hides tokens before real ones (left padding, or a mask that is not one row "
                          "per sequence); pad on the right (tokenizer.padding_side = 'right'; disttrain's collate "
                          f"does) or run without {setting}")
    if positions is not None and (not isinstance(positions, torch.Tensor) or bool(
            (positions != torch.arange(positions.shape[-1], device=positions.device)).any())):
        raise ConfigError(f"{setting} > 1 ignores position_ids that restart inside a row, and this batch's "
                          "position_ids are not 0, 1, 2, ... in every row (packed sequences); give one sequence per "
                          f"row without position_ids, or run without {setting}")


def _pad_cat(ids: list[torch.Tensor], multiple: int = 1) -> torch.Tensor:
    """Micro-batches of different widths, right-padded to one, a `multiple` of tokens (causal models: padding never
    reaches earlier positions, and each micro-batch's loss reads only its own width; a sequence-parallel stream
    splits into equal shares, as the schedule's shapes and a stage's rotary positions take them)."""
    width = -(-max(t.shape[1] for t in ids) // multiple) * multiple
    return torch.cat([nn.functional.pad(t, (0, width - t.shape[1])) for t in ids])


class StageRunner(nn.Module):
    """`Prepared.module` under a pipeline, for forward-only calls (evaluation): the stages run one after another,
    each on its rank, activations passed with point-to-point sends; the last stage's rank returns the logits, the
    others an empty tensor. Training never calls it: the schedule runs the stages."""

    def __init__(self, prepared: PipelinePrepared):
        super().__init__()
        self.parts = nn.ModuleList(part for _, part in prepared.parts)
        self._prepared = [prepared]  # not a submodule

    def forward(self, input_ids: torch.Tensor, **ignored) -> torch.Tensor:
        """(Other arguments of the model's call, e.g. an HF attention mask, are not passed between stages: the
        stages attend causally, which right padding never changes for the positions before it.)"""
        p = self._prepared[0]
        if p.context is None:
            check_mask(ignored)
        lay, mine = p.layout, dict(p.parts)
        width = input_ids.shape[1]
        input_ids = _pad_cat([input_ids], lay.shards)  # (equal shares of a sequence-parallel stream)
        x, out = input_ids, torch.empty(0)
        for stage in range(lay.stages):
            holder = lay.holder(stage)
            if stage > 0 and holder == lay.rank and lay.holder(stage - 1) != lay.rank:
                rows, padded = input_ids.shape
                x = torch.empty((rows, padded // lay.shards, lay.hidden), dtype=lay.dtype, device=input_ids.device)
                dist.recv(x, group=lay.group, group_src=lay.holder(stage - 1))
            if holder != lay.rank:
                continue
            x = mine[stage](x)
            if stage == lay.stages - 1:
                out = x[:, :width]
            elif lay.holder(stage + 1) != lay.rank:
                dist.send(x.contiguous(), group=lay.group, group_dst=lay.holder(stage + 1))
        return out


def _sizes(model: nn.Module) -> tuple[int, int]:
    """(hidden size, vocabulary size)."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "hidden_size"):
        return int(config.hidden_size), int(config.vocab_size)
    return model.cfg.d_model, model.cfg.vocab_size


def prepare(model: nn.Module, runtime, parallel, device_mesh, apply_data: Callable[[nn.Module], Prepared] | None,
            dtype, materialize: Callable[[nn.Module, list[list[str]]], None] | None = None) -> PipelinePrepared:
    """Split `model` into this rank's stage(s), wrap each in the data axis (`apply_data`, None: no data axis).
    `materialize(model, tie_groups)`: for a model on the meta device (a sharded start), makes the stages this rank
    kept real and reads their weights, once the others are pruned (the tie groups name a tied head's tensor)."""
    pp_mesh = device_mesh["pp"]
    lay = StageLayout(stage_count(parallel, pp_mesh.size()), pp_mesh.size(), pp_mesh.get_local_rank(),
                      pp_mesh.get_group(), parallel.pipeline_schedule, *_sizes(model), dtype,
                      getattr(model, SEQUENCE_SHARDS, 1))
    fam = FAMILIES[family_of(model)]
    bounds = stage_bounds(model, lay.stages, parallel.pipeline_split, warn=runtime.rank == 0)
    mine = stages_of(lay.rank, lay.ranks, lay.stages, lay.schedule)
    first, last = 0 in mine, lay.stages - 1 in mine
    ties = tie_groups(model)
    parts = [(s, StagePart(model, fam, bounds[s], s == 0, s == lay.stages - 1)) for s in mine]
    prune(model, fam, [bounds[s] for s in mine], first, last)
    if materialize is not None:  # a sharded start: this rank allocates and reads its own stage(s) only, in full
        materialize(model, ties)
    # a V's rank 0 runs the first and the last stage: a tied embedding and head would be one parameter in two
    # data-parallel roots (each stage is its own), which FSDP2 cannot hold; the head gets a copy of its own
    twins = untie_head(model, fam, ties) if first and last and apply_data is not None else []
    wrapped = [(s, apply_data(part) if apply_data else None) for s, part in parts]
    prepared = PipelinePrepared(module=model, model=model, layout=lay)
    if apply_data is not None:
        inner = wrapped[0][1]
        prepared.grads_averaged_over = inner.grads_averaged_over
        prepared.comm = inner.comm
        contexts = [w.no_sync for _, w in wrapped]
        prepared.no_sync = lambda: _all(contexts)
    prepared.parts = [(s, w.module if w is not None else part) for (s, part), (_, w) in zip(parts, wrapped,
                                                                                             strict=True)]
    prepared.module = StageRunner(prepared)
    prepared.norm_group = lay.group
    prepared.tie_pairs = tie_pairs(model, ties, device_mesh, first, last)
    params = dict(model.named_parameters())  # as the data axis left them (FSDP2 replaces the parameters)
    prepared.twins = [(params[a], params[b]) for a, b in twins]
    if last and not first:  # the first stage's copy of a tied weight counts in the norm
        prepared.norm_skip = {id(param) for param, _ in prepared.tie_pairs}
    prepared.norm_skip |= {id(copy) for _, copy in prepared.twins}
    fns = local_state_fns(model, ties)
    prepared.state_dict, prepared.load_state_dict = fns["state_dict"], fns["load_state_dict"]
    prepared.checkpoint_target, prepared.local_state = fns["checkpoint_target"], True
    return prepared


def _all(contexts):
    stack = contextlib.ExitStack()
    for context in contexts:
        stack.enter_context(context())
    return stack
