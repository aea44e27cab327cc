"""One composition of the parallel axes: `prepare(spec, model, runtime, parallel)` is what `create_backend`
calls for every strategy.

A job whose model and sequences are not split (parallel.pipeline = parallel.tensor = parallel.context = 1) goes to
the strategy as it always has, over all ranks. Otherwise the ranks form one DeviceMesh (parallel/mesh.py: pp x
dp_replicate x dp_shard x tp, the context ranks folded into the data axis) and the axes are applied innermost first,
as torchtitan does:

    tensor     parallel/tensor.py splits each block over the `tp` axis (parameters become DTensors) and, without
               a pipeline, leaves the logits split by vocabulary for the loss (`Prepared.split_logits`)
    data       the strategy over the data axes only (`mesh=`: DDP on the dp_replicate group, FSDP2 on dp_shard
               or dp_replicate x dp_shard); skipped when the data-parallel degree (x context) is 1
    pipeline   parallel/pipeline.py splits the (tensor-parallel) model into stages; the data axis (x context) wraps
               each stage
    context    parallel/context.py gives each attention the rank's share (`Prepared.context`: the backend cuts batches;
               a pipeline's stages take their positions)

The `Prepared` it returns says which share of each batch this rank reads (`data_parallel`) and whether its loss
counts in the global totals (one rank per data shard and share of the sequences), so the backend and the Trainer stay as
they are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from disttrain.parallel import mesh as layouts
from disttrain.parallel.spec import Prepared, StrategySpec
from disttrain.parallel.state import dtensor_targets, full_state_dict_fns
from disttrain.precision import get_precision

if TYPE_CHECKING:
    from torch import nn


def prepare(spec: StrategySpec, model: nn.Module, runtime, parallel, materialize=None) -> Prepared:
    """`materialize(model, tie_groups)`: given for a model on the meta device; a pipeline calls it on this rank's
    stages once it has pruned the rest (other layouts leave the model to the caller, sharded)."""
    layout = layouts.layout_for(parallel, runtime.world_size, spec)
    if not layout.model_parallel:
        return spec.apply(model, runtime, parallel)
    device_mesh = layouts.device_mesh(layout, runtime.device.type)
    split_logits = None  # loss parallel's context, where the head's logits stay split by vocabulary
    if layout.tensor > 1:
        from disttrain.parallel import tensor

        split = tensor.splits_logits(parallel, layout, tensor.vocabulary(model))
        tensor.parallelize(model, device_mesh["tp"], parallel.sequence_parallel, split)
        split_logits = tensor.LossParallel() if split else None
    if layout.pipeline > 1:
        from disttrain.parallel import pipeline

        data = None  # (context ranks reduce their gradients as data ranks do)
        if layout.data * layout.context > 1:
            data = lambda part: spec.apply(part, runtime, parallel, mesh=device_mesh)  # noqa: E731
        # the stream between stages: the parameters' dtype, or FSDP2's compute dtype under mixed precision
        compute = get_precision(parallel.precision).compute_dtype
        stream = compute if compute is not None and data is not None else next(model.parameters()).dtype
        prepared = pipeline.prepare(model, runtime, parallel, device_mesh, data, stream, materialize)
    elif layout.data * layout.context > 1:  # (context ranks reduce their gradients as data ranks do)
        prepared = spec.apply(model, runtime, parallel, mesh=device_mesh)
    else:
        prepared = Prepared(module=model, model=model, checkpoint_target=dtensor_targets(model),
                            **full_state_dict_fns(model, sharded=True))
    prepared.data_parallel = (layout.data, layout.data_rank(runtime.rank))
    prepared.counts_loss = layout.counts_loss(runtime.rank)
    prepared.split_logits = split_logits
    if parallel.sequence_parallel and layout.pipeline == layout.context == 1:
        prepared.sequence_multiple = layout.tensor
    if layout.context > 1:
        from disttrain.parallel.context import ContextParallel

        prepared.context = ContextParallel(layouts.context_groups(layout), layout.context,
                                           layout.coords(runtime.rank)["cp"], prepared.comm,
                                           layout.tensor if parallel.sequence_parallel else 1, bool(parallel.compile))
        prepared.context.parallelize(model)
        prepared.cuts_context = layout.pipeline > 1  # (one width for all of a step's micro-batches: pipeline.py)
    return prepared
