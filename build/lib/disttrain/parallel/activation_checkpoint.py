"""Activation checkpointing, and finding the transformer blocks that it (and FSDP2's per-block sharding) works on."""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks (to shard or checkpoint one by one): the elements of the largest ModuleList."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def leading_frozen_blocks(model: nn.Module) -> int | None:
    """How many transformer blocks, from the first, hold only frozen parameters (model.freeze), where every
    parameter registered before the first block (the embeddings) is frozen too: nothing before the first trained
    parameter needs a gradient, so autograd neither keeps activations for them nor runs their backward. None where a
    parameter before the blocks trains."""
    blocks = transformer_blocks(model)
    first = {id(p) for p in blocks[0].parameters()} if blocks else set()
    for param in model.parameters():  # in registration order: the embeddings before the blocks
        if id(param) in first:
            break
        if param.requires_grad:
            return None
    return next((i for i, block in enumerate(blocks) if any(p.requires_grad for p in block.parameters())),
                len(blocks))


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each transformer block's activations in backward instead of keeping them.

    The block's forward is wrapped in place (non-reentrant `torch.utils.checkpoint`), so parameter names and
    checkpoints are unchanged, and it composes with whichever strategy is applied afterwards (DDP, FSDP2).
    """
    for block in transformer_blocks(model):
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
