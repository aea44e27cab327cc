"""FSDP2 (`fully_shard`) strategies: `fsdp` (alias `zero3`), `zero2` and `hsdp`.

Each transformer block is sharded on its own, then the root, as torchtitan does: a block's parameters are
all-gathered just before it runs and freed after (`reshard_after_forward`), gradients are reduce-scattered
(averaged over the data-parallel ranks), and the optimizer only ever sees this rank's shards. The root's
parameters (embeddings, head, final norm) stay gathered from forward to backward, which begins with them (outside
a pipeline): gathered once per micro-batch, not twice.

- `fsdp` / `zero3`: parameters, gradients and optimizer state sharded (`zero3` is the documented alias,
  the name DeepSpeed users know).
- `zero2`: the same, but parameters stay unsharded from forward to backward (`reshard_after_forward=False`):
  gradients and optimizer state sharded, no second all-gather in backward.
- `hsdp`: shard within groups of `parallel.hsdp_shard_size` ranks, replicate across the groups (a 2-D
  device mesh: replicate x shard).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
from typing import TYPE_CHECKING

from disttrain.errors import ConfigError
from disttrain.parallel import comm, layout
from disttrain.parallel.activation_checkpoint import transformer_blocks
from disttrain.parallel.mesh import SPLIT_BACKWARD_SCHEDULES
from disttrain.parallel.spec import Prepared, StrategySpec
from disttrain.parallel.state import dtensor_targets, full_state_dict_fns
from disttrain.precision import get_precision

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # FSDP2 (and DTensor under it) is imported when a strategy applies, not by the launcher's
    from torch import nn  # validation of the settings (~0.7 s of every `disttrain train --nproc N`)
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy


def reshard_gathered(module: nn.Module) -> None:
    """Free the gathered parameters a forward without gradients leaves behind. Units that do not reshard after
    forward (every root, zero2's, a split-backward pipeline's) stay gathered until a backward; an optimizer step
    before one would leave them holding the old weights, since the next forward skips a gathered unit's all-gather
    (the TrainingService's forward between a backward and `optim_step`: seen as losses 0.15 off). A no-op where FSDP2
    was never imported or nothing is gathered."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return
    for unit in module.modules():
        if isinstance(unit, fsdp.FSDPModule):
            unit.reshard()


def _shard(model: nn.Module, runtime, cfg, reshard_after_forward: bool,
           mesh_shape: tuple[int, ...] | None = None, mesh=None) -> Prepared:
    """FSDP2 over `mesh` (the data axes of a composed layout, parallel/compose.py), else over a mesh of all ranks
    (`mesh_shape`: replicate x shard)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    device_type = runtime.device.type
    if mesh is not None and cfg.pipeline > 1 and cfg.pipeline_schedule in SPLIT_BACKWARD_SCHEDULES:
        # the weight part of a split backward finds the parameters' gradient nodes through the module's parameters,
        # which must be the (unsharded) ones the forward used: resharded, no gradient would reach them
        reshard_after_forward = False
    if mesh is not None:
        pass
    elif mesh_shape is None:
        mesh = init_device_mesh(device_type, (runtime.world_size,))
    else:
        mesh = init_device_mesh(device_type, mesh_shape, mesh_dim_names=("replicate", "shard"))
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward,
              "mp_policy": _mixed_precision(cfg)}
    if cfg.cpu_offload:  # pinned host memory needs an accelerator; on a CPU run the shards stay where they are
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device_type == "cuda")
    blocks = list(transformer_blocks(model))
    for block in blocks:
        fully_shard(block, **kwargs)
    if cfg.pipeline <= 1:
        # the root (embeddings, head, final norm) is the first unit backward needs, right after the loss: resharding
        # it after forward would only gather it again at once (torch's own default for a root, and torchtitan's for
        # the head). A pipeline stage's backward comes other micro-batches later, so there it stays as configured.
        kwargs["reshard_after_forward"] = False
    fully_shard(model, **kwargs)
    if cfg.fsdp_prefetch:
        _explicit_prefetch(blocks, cfg.fsdp_prefetch)
    meter = comm.meter_for(runtime.device)
    if meter is not None:
        all_gather, reduce_scatter, all_reduced = comm.fsdp_comms(meter)
        replicated = mesh.ndim == 2 and mesh.size(0) > 1  # HSDP: FSDP2 also all-reduces over the replicate groups
        for module in [*blocks, model]:
            module.set_custom_all_gather(all_gather)
            module.set_custom_reduce_scatter(reduce_scatter)
            if replicated:
                module.set_all_reduce_hook(all_reduced)
    return Prepared(module=model, model=model, no_sync=lambda: _no_gradient_sync(model),
                    grads_averaged_over=mesh.size(), checkpoint_target=dtensor_targets(model),
                    comm=meter, **full_state_dict_fns(model, sharded=True))


def _mixed_precision(cfg) -> MixedPrecisionPolicy:
    """The precision's policy, with gradients reduced in `parallel.grad_compression`'s dtype when one is set."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = get_precision(cfg.precision).fsdp_policy() or MixedPrecisionPolicy()
    wire = comm.reduce_dtype(cfg.grad_compression)
    return policy if wire is None else dataclasses.replace(policy, reduce_dtype=wire)


def _explicit_prefetch(blocks: list[FSDPModule], depth: int) -> None:
    """Each block issues the all-gathers of the next `depth` blocks (in execution order: forward, then
    reversed for backward) before it runs, so more communication overlaps compute than FSDP2's implicit
    one-block prefetch, at the cost of `depth` blocks of gathered parameters held at once."""
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + depth])
    backward = blocks[::-1]
    for i, block in enumerate(backward):
        block.set_modules_to_backward_prefetch(backward[i + 1:i + 1 + depth])


@contextlib.contextmanager
def _no_gradient_sync(model: FSDPModule):
    """Accumulate unsharded gradients locally; the next synced backward reduce-scatters them all."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def apply_fsdp(model: nn.Module, runtime, cfg, mesh=None) -> Prepared:
    return _shard(model, runtime, cfg, cfg.reshard_after_forward, mesh=_data_mesh(mesh, "dp_shard"))


def apply_zero2(model: nn.Module, runtime, cfg, mesh=None) -> Prepared:
    return _shard(model, runtime, cfg, reshard_after_forward=False, mesh=_data_mesh(mesh, "dp_shard"))


def apply_hsdp(model: nn.Module, runtime, cfg, mesh=None) -> Prepared:
    if mesh is not None:
        _warn_across_nodes(runtime, mesh["dp_shard"].size(), mesh["dp_shard"].size() * mesh["tp"].size(), cfg)
        return _shard(model, runtime, cfg, cfg.reshard_after_forward, mesh=mesh["dp_replicate", "dp_shard"])
    shard = cfg.hsdp_shard_size or runtime.world_size
    _warn_across_nodes(runtime, shard, shard, cfg)
    return _shard(model, runtime, cfg, cfg.reshard_after_forward, mesh_shape=(runtime.world_size // shard, shard))


def _warn_across_nodes(runtime, shard: int, spanned: int, cfg) -> None:
    """HSDP is for sharding within a node and replicating across nodes: say so (once, on rank 0) where a shard
    group's `spanned` consecutive ranks (its shards, and the tensor-parallel ranks within each) reach past one node,
    so that its all-gathers and reduce-scatters cross the slower links every block."""
    local = runtime.launch.local_world_size
    if runtime.rank == 0 and runtime.world_size > local and spanned > local:
        fits = max(1, local // max(1, spanned // shard))
        log.warning("parallel.hsdp_shard_size = %d: each shard group spans %d ranks, more than the %d of a node, so "
                    "FSDP's collectives cross nodes every block; set parallel.hsdp_shard_size = %d to shard within "
                    "a node and replicate across nodes", cfg.hsdp_shard_size, spanned, local, fits)


def replicate(model: nn.Module, runtime, cfg, mesh) -> Prepared:
    """Plain data parallelism over the `dp_replicate` axis of a composed layout, as FSDP2 on a replicate x 1 mesh
    (gradients all-reduced, parameters whole): DDP cannot hold the DTensor parameters of tensor parallelism."""
    return _shard(model, runtime, cfg, reshard_after_forward=False, mesh=mesh["dp_replicate", "dp_shard"])


def _data_mesh(mesh, axis: str):
    return None if mesh is None else mesh[axis]


def check_hsdp(cfg, data: int) -> None:
    check_fsdp(cfg, data)
    hsdp_axes(cfg.parallel, data)


def check_fsdp(cfg, world: int) -> None:
    if cfg.parallel.grad_compression == "powersgd":
        raise ConfigError(f"parallel.grad_compression = 'powersgd' is a DDP communication hook and "
                          f"{cfg.parallel.strategy!r} reduce-scatters its gradients; use 'bf16' or 'fp16' (the FSDP "
                          "reduce dtype), or parallel.strategy = 'ddp'")
    if cfg.parallel.fsdp_prefetch < 0:
        raise ConfigError(f"parallel.fsdp_prefetch = {cfg.parallel.fsdp_prefetch}: must be >= 0 (0 = FSDP2's default)")


def hsdp_axes(p, data: int) -> tuple[int, int]:
    """(replicate, shard) of `data` data-parallel ranks (the world size unless pipeline/tensor take some)."""
    shard = p.hsdp_shard_size or data
    if p.hsdp_shard_size < 0 or data % shard:
        raise ConfigError(f"parallel.hsdp_shard_size = {p.hsdp_shard_size} does not divide the {data} data-parallel "
                          f"ranks (the world size / (parallel.pipeline x parallel.tensor)); choose a divisor of {data}")
    return data // shard, shard


def sharded_axes(p, data: int) -> tuple[int, int]:
    return 1, data


def memory_fsdp(shapes, cfg, world: int, rank: int | None, mesh=None) -> layout.MemoryLayout:
    return _gathered_note(layout.sharded(shapes, cfg, world), cfg)


def _gathered_note(out: layout.MemoryLayout, cfg) -> layout.MemoryLayout:
    if cfg.parallel.pipeline > 1 and cfg.parallel.pipeline_schedule in SPLIT_BACKWARD_SCHEDULES:
        out.notes.append(f"under {cfg.parallel.pipeline_schedule} a stage keeps its blocks' full parameters from "
                         "forward to backward, as zero2 (reshard_after_forward does not apply)")
    return out


def memory_replicate(shapes, cfg, world: int, rank: int | None) -> layout.MemoryLayout:
    """`replicate`'s layout: FSDP2 on one shard (whole parameters, gradients and optimizer state; its mixed-precision
    policy casts the weights, so no autocast copies are saved)."""
    return layout.sharded(shapes, cfg, 1)


def memory_zero2(shapes, cfg, world: int, rank: int | None, mesh=None) -> layout.MemoryLayout:
    out = layout.sharded(shapes, cfg, world)
    out.notes.append("zero2 also holds each block's full parameters from its forward to its backward")
    return out


def memory_hsdp(shapes, cfg, world: int, rank: int | None, mesh=None) -> layout.MemoryLayout:
    # (context ranks join the shard groups: parallel/mesh.py)
    shard = cfg.parallel.hsdp_shard_size * (mesh.context if mesh is not None else 1)
    return _gathered_note(layout.sharded(shapes, cfg, shard or world), cfg)


COMMON = frozenset({"cpu_offload", "fsdp_prefetch", "grad_compression"})
SPECS = (
    StrategySpec("zero2", apply_zero2, "FSDP2, parameters kept gathered from forward to backward: gradients and "
                 "optimizer state sharded", memory_zero2, check_fsdp, shards_parameters=True, options=COMMON,
                 data_axes=sharded_axes),
    StrategySpec("fsdp", apply_fsdp, "FSDP2 fully_shard per block: parameters, gradients and optimizer state "
                 "sharded", memory_fsdp, check_fsdp, shards_parameters=True,
                 options=COMMON | {"reshard_after_forward"}, aliases=("zero3",), data_axes=sharded_axes),
    StrategySpec("hsdp", apply_hsdp, "FSDP2 on a replicate x shard mesh (parallel.hsdp_shard_size ranks per shard "
                 "group)", memory_hsdp, check_hsdp,
                 shards_parameters=True, options=COMMON | {"reshard_after_forward", "hsdp_shard_size"},
                 data_axes=hsdp_axes),
)
