"""A model split in the scale model (scale_model.py): a tensor split's rank's share of a model, a context split's
calls, the splits' own collectives' seconds, and what the model does not price of them (a pipeline's too:
`check_pipeline`). Pure Python, as scale_model."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import TYPE_CHECKING

from disttrain.bench.interconnect import ITEMSIZE, Interconnect, bus_factor, collective_time
from disttrain.bench.model_shapes import ModelShape, UnitShape
from disttrain.errors import ConfigError
from disttrain.parallel import mesh

if TYPE_CHECKING:
    from disttrain.bench.scale_model import Workload


def split_shape(model: ModelShape, tensor: int) -> ModelShape:
    """One rank's share of `model` under a tensor split of `tensor` ranks: every unit's parameters and trained
    tensors divided by it (its compute shares kept). The norms and positions a split leaves whole are counted split
    too: a few thousand parameters a block."""
    if tensor == 1:
        return model
    return replace(model, params=model.params / tensor, layer_params=model.layer_params / tensor,
                   counted=tuple(UnitShape(u.params / tensor, u.trained / tensor, u.forward_flops,
                                                  u.backward_flops) for u in model.units()),
                   grad_tensors=tuple(x / tensor for x in model.grad_tensors))


def check_tensor(strategy: str, n: int, work: Workload, net: Interconnect) -> None:
    """What the model does not price of a tensor split: a count it does not divide, a group not within a node, hsdp
    with it; and what disttrain does not run: zero1 (no data axes) or powersgd under a model split."""
    t = work.tensor
    if t == 1:
        return
    _check_group("parallel.tensor", t, n, net, "each block's collectives hold up its compute")
    check_model_split(strategy, work, f"parallel.tensor = {t}")


def _check_group(setting: str, degree: int, n: int, net: Interconnect, why: str) -> None:
    """A split's groups of `degree` neighbouring GPUs: whole ones in `n`, each within a node (`why` the model does
    not price them across nodes)."""
    if n % degree:
        raise ConfigError(f"{setting} = {degree} does not divide {n} GPUs; give GPU counts that are multiples of it")
    if net.gpus_per_node % degree:
        raise ConfigError(f"{setting} = {degree}: its groups would straddle nodes of {net.gpus_per_node} devices, "
                          f"which the model does not price ({why}); give a divisor of {net.gpus_per_node}")


def check_model_split(strategy: str, work: Workload, split: str) -> None:
    if strategy in ("hsdp", "zero1"):
        why = "is not modelled" if strategy == "hsdp" else "does not run in disttrain (zero1 has no data axes)"
        raise ConfigError(f"{strategy} with {split} {why}; predict ddp or fsdp with it")
    if work.grad_compression == "powersgd":
        raise ConfigError(f"parallel.grad_compression = 'powersgd' with {split} does not run in disttrain (a DDP "
                          "hook over every rank); predict it with none, fp16 or bf16")


def context_calls(model: ModelShape, compute: str, recompute: bool = False) -> tuple[tuple[str, str, float, str], ...]:
    """(part, collective, bytes, dtype) of one sequence's context-split collectives, as parallel/context.py sends
    them: each block's attention gathers its keys and values from the group's ranks (two all-gathers in the compute
    dtype, of the whole sequence's keys: nccl-tests' size), and backward reduce-scatters their gradients summed in
    float32 (two); `recompute` (activation checkpointing): the gathers again in backward (the block's collectives
    are not its last computation, so torch's checkpoint recomputes them)."""
    size = model.seq_len * model.kv_width
    gather = ("all_gather", size * ITEMSIZE[compute], compute)
    block = ((("forward", *gather),) * 2 + (("backward", "reduce_scatter", size * 4, "float32"),) * 2
             + (("backward", *gather),) * 2 * recompute)
    return block * model.n_layer


def check_context(strategy: str, n: int, work: Workload, net: Interconnect) -> None:
    """What the model does not price of a context split (a count it does not divide, a group not within a node
    (with a tensor split, both within one), a model whose keys' width is not known, hsdp) and what disttrain does
    not run (with a pipeline and a tensor split together, zero1, powersgd)."""
    c, t = work.context, work.tensor
    if c == 1:
        return
    if work.pipeline > 1 and t > 1:
        raise ConfigError(f"parallel.context = {c} with parallel.pipeline and parallel.tensor together does not run "
                          "in disttrain yet; predict the context split with one of them")
    names = "parallel.context" if t == 1 else "parallel.tensor x parallel.context"
    _check_group(names, c * t, n, net, "each attention's gathers hold up its compute")
    if not work.model.kv_width:
        raise ConfigError(f"parallel.context = {c}: {work.model.name} has no attention the model knows of (its keys' "
                          "width); predict a transformer, or parallel.context = 1")
    check_model_split(strategy, work, f"parallel.context = {c}")


def stage_context_calls(work: Workload, stage: ModelShape) -> tuple[tuple[str, str, float, str], ...]:
    """A pipeline stage's share of `work.context_calls`: its blocks' (each block sends the same calls)."""
    if not work.context_calls:
        return ()
    per_block = len(work.context_calls) // work.model.n_layer
    return work.context_calls[:per_block * stage.n_layer]


def rank_context_calls(work: Workload, stages: list[int]) -> tuple[tuple[str, str, float, str], ...]:
    """A pipeline rank's share of `work.context_calls`: its stages' blocks' together."""
    return tuple(call for s in stages for call in stage_context_calls(work, work.stages[s]))


def split_seconds(work: Workload, net: Interconnect) -> tuple[tuple[float, float, float], tuple[float, float]]:
    """((forward, backward) seconds of one micro-batch's collectives of a tensor or context split, and the step's,
    (bytes each rank sends in a micro-batch, in the step)). The step's are issued together (DTensor's functional
    collectives return at once; the clip's norm and the optimizer wait once all are out): on links with a cost per
    call (a CPU host's fit, `Link.call_s`) the run pays it once, the others only their bytes (measured here: the
    clip's 20 of a sequence-parallel step's 38 calls changed its time by nothing); on an accelerator's links each
    call still pays its ring's latency."""
    seconds, sent = {"forward": 0.0, "backward": 0.0, "step": 0.0}, {"forward": 0.0, "backward": 0.0, "step": 0.0}
    calls = [(call, work.tensor) for call in work.tensor_calls] + [(call, work.context) for call in work.context_calls]
    for (part, collective, nbytes, dtype), ranks in calls:
        links = net.for_dtype(dtype, collective)
        call = collective_time(collective, nbytes, ranks, links)
        if part == "step" and sent["step"]:  # (issued together with the first: its cost per call paid once)
            call -= links.intra[collective].call_s
        seconds[part] += call
        sent[part] += nbytes * bus_factor(collective, ranks)
    return (seconds["forward"], seconds["backward"], seconds["step"]), (sent["forward"] + sent["backward"],
                                                                        sent["step"])


MODELLED_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv", "dualpipev")
"""Pipeline schedules the model plays: all of disttrain's (dualpipev's overlapped forward-backward pairs as torch's
runtime runs them: the forward, then the backward). Their stages per rank and which split the backward (FSDP2 then
keeps a stage's parameters gathered from forward to backward: priced as zero2) are parallel/mesh.py's."""


def check_pipeline(strategy: str, n: int, work: Workload) -> int:
    """A pipeline's stages per rank (v), or one line for what the model does not price or disttrain does not run."""
    if work.schedule not in MODELLED_SCHEDULES:
        raise ConfigError(f"parallel.pipeline_schedule = {work.schedule!r} is not modelled; predict "
                          f"{', '.join(MODELLED_SCHEDULES)}")
    if work.schedule == "dualpipev" and work.micro_steps < 2 * work.pipeline:
        raise ConfigError(f"parallel.pipeline_schedule = 'dualpipev' runs at least 2 x parallel.pipeline = "
                          f"{2 * work.pipeline} micro-batches a step, not {work.micro_steps}; give a batch of as many")
    layout = SimpleNamespace(pipeline=work.pipeline, pipeline_schedule=work.schedule,
                             pipeline_stages_per_rank=work.virtual)
    mesh.check_stages_per_rank(layout)
    p, v = work.pipeline, mesh.stages_per_rank(layout)
    if n % p:
        raise ConfigError(f"parallel.pipeline = {p} does not divide {n} GPUs; give multiples of it")
    if work.cpu_cores and (n > p or p > work.cpu_cores):
        raise ConfigError(f"parallel.pipeline = {p} on {n} ranks of a CPU host with {work.cpu_cores} cores is not "
                          "modelled (a tensor or context split or data parallelism beside it, or more stages than "
                          "cores: ranks sharing the cores); predict the pipeline alone, on as many ranks as cores")
    if v > 1 and work.schedule not in mesh.V_SCHEDULES and work.micro_steps % p:
        raise ConfigError(f"parallel.pipeline_schedule = {work.schedule!r} runs micro-batches in multiples of "
                          f"parallel.pipeline = {p}, not {work.micro_steps}; give a batch of such micro-batches")
    assert len(work.stages) == p * v, "a pipeline's Workload holds each stage"
    assert work.tensor == 1 or (len(work.stage_calls), len(work.step_calls)) == (p * v, p), "and a split's calls"
    assert bool(work.orders) == (v > 1), "torch's order of a multi-stage schedule"
    check_model_split(strategy, work, f"parallel.pipeline = {p}")
    return v
