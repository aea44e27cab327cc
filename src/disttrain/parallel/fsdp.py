"""FSDP2 (`fully_shard`) strategies: `fsdp` (= `zero3`), `zero2` and `hsdp`.

Each transformer block is sharded on its own, then the root, as torchtitan does: a block's parameters are
all-gathered just before it runs and freed after (`reshard_after_forward`), gradients are reduce-scattered
(averaged over the data-parallel ranks), and the optimizer only ever sees this rank's shards.

- `fsdp` / `zero3`: parameters, gradients and optimizer state sharded (`zero3` is the documented alias,
  the name DeepSpeed users know).
- `zero2`: the same, but parameters stay unsharded from forward to backward (`reshard_after_forward=False`):
  gradients and optimizer state sharded, no second all-gather in backward.
- `hsdp`: shard within groups of `parallel.hsdp_shard_size` ranks, replicate across the groups (a 2-D
  device mesh: replicate x shard).
"""

from __future__ import annotations

import contextlib

from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from disttrain.config import ParallelConfig
from disttrain.parallel import Prepared, full_state_dict_fns
from disttrain.parallel.blocks import transformer_blocks
from disttrain.precision import get_precision
from disttrain.runtime import Runtime


def _shard(model: nn.Module, runtime: Runtime, cfg: ParallelConfig, reshard_after_forward: bool,
           mesh_shape: tuple[int, ...] | None = None) -> Prepared:
    if not runtime.distributed:
        raise ValueError("FSDP strategies need an initialised process group (launch with --nproc N)")
    device_type = runtime.device.type
    if mesh_shape is None:
        mesh = init_device_mesh(device_type, (runtime.world_size,))
    else:
        mesh = init_device_mesh(device_type, mesh_shape, mesh_dim_names=("replicate", "shard"))
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward,
              "mp_policy": get_precision(cfg.precision).fsdp_policy() or MixedPrecisionPolicy()}
    if cfg.cpu_offload:  # pinned host memory needs an accelerator; on a CPU run the shards stay where they are
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device_type == "cuda")
    blocks = list(transformer_blocks(model))
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    if cfg.fsdp_prefetch:
        _explicit_prefetch(blocks, cfg.fsdp_prefetch)
    return Prepared(module=model, model=model, no_sync=lambda: _no_gradient_sync(model),
                    grads_averaged_over=runtime.world_size, checkpoint_target=_sharded_targets(model),
                    **full_state_dict_fns(model, sharded=True))


def _sharded_targets(model: nn.Module):
    """Load a DCP checkpoint shard by shard: parameters and their optimizer moments (same global shape)
    into empty DTensors sharded like the parameter; anything else (steps, scalars) as a full tensor."""
    import torch

    params = dict(model.named_parameters(remove_duplicate=False))  # tied weights under each name

    def target(key: str, size, dtype):
        name = key.removeprefix("model.")
        if key.startswith("optimizer.state."):
            name = key.removeprefix("optimizer.state.").rsplit(".", 1)[0]
        param = params.get(name)
        if param is not None and tuple(param.shape) == tuple(size) and hasattr(param, "to_local"):
            return torch.empty_like(param, dtype=dtype)
        return torch.empty(size, dtype=dtype)

    return target


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


def apply_fsdp(model: nn.Module, runtime: Runtime, cfg: ParallelConfig) -> Prepared:
    return _shard(model, runtime, cfg, reshard_after_forward=cfg.reshard_after_forward)


def apply_zero2(model: nn.Module, runtime: Runtime, cfg: ParallelConfig) -> Prepared:
    return _shard(model, runtime, cfg, reshard_after_forward=False)


def apply_hsdp(model: nn.Module, runtime: Runtime, cfg: ParallelConfig) -> Prepared:
    shard = cfg.hsdp_shard_size or runtime.world_size
    if runtime.world_size % shard:
        raise ValueError(f"parallel.hsdp_shard_size = {shard} does not divide the world size {runtime.world_size}")
    return _shard(model, runtime, cfg, cfg.reshard_after_forward, mesh_shape=(runtime.world_size // shard, shard))
