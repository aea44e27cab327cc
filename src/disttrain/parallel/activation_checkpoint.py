"""Activation checkpointing and compiling, and finding the transformer blocks that they (and FSDP2's per-block
sharding) work on."""

from __future__ import annotations

from torch import nn
from torch.utils.checkpoint import checkpoint

from disttrain.errors import ConfigError


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
        block.forward = _checkpointed(block.forward)


def _checkpointed(forward):
    """`forward` run under a non-reentrant checkpoint. A function (not a `functools.partial` of `checkpoint`, which
    dynamo does not trace at all: `parallel.compile` would run such blocks eagerly) that a compiled block traces as
    torch's checkpoint operator, recomputed in its backward graph."""
    def checkpointed(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return checkpointed


def check_compile(p) -> None:
    """ConfigError (one line) where `parallel.compile` (`p`: the ParallelConfig) names no torch.compile backend
    (imports torch._dynamo: ~1 s), or meets what it does not compose with, as seen in disttrain's checks (torch 2.13,
    CPU, gloo): a tensor split (a Hugging Face Llama's compiled tensor-parallel layers failed in backward, and with
    sequence and loss parallelism trained 8e-3 off the eager run); DeepSpeed's ZeRO-3 (its hooks on every module
    recompile past dynamo's limit: run eagerly); activation checkpointing over a context split (the keys' gathers run
    between graphs, and a checkpoint cannot hold a graph break: dynamo ran the whole block eagerly). `mesh.layout_for`
    calls it (validation, the TrainingService's driver, `compose.prepare`), and `create_backend` first of all."""
    import torch._dynamo

    if p.compile not in torch._dynamo.list_backends(exclude_tags=()):  # (the debugging ones too, e.g. aot_eager)
        raise ConfigError(f"parallel.compile = {p.compile!r} is not a torch.compile backend here; give one of "
                          f"{', '.join(torch._dynamo.list_backends())}, aot_eager or eager, or \"\" for none")
    why = ""
    if p.tensor > 1:
        why = (f"with parallel.tensor = {p.tensor}: compiled tensor-parallel blocks failed or trained off the eager "
               "run in disttrain's checks (torch 2.13); set parallel.tensor = 1")
    elif p.strategy == "deepspeed" and p.deepspeed_stage == 3:
        why = ("with DeepSpeed's ZeRO-3: its hooks on every module exceed dynamo's recompile limit, so the blocks "
               "would run eagerly; use parallel.strategy = 'fsdp' or parallel.deepspeed_stage <= 2")
    elif p.context > 1 and p.activation_checkpointing:
        why = (f"with parallel.context = {p.context} and activation checkpointing: the keys' gathers run between "
               "graphs, which a checkpointed block cannot, so it would run eagerly; set "
               "parallel.activation_checkpointing = false")
    if why:
        raise ConfigError(f"parallel.compile = {p.compile!r} {why}, or parallel.compile = \"\"")


def compile_blocks(model: nn.Module, backend: str) -> None:
    """`torch.compile` each transformer block in place with `backend` (`nn.Module.compile`: the module, its names,
    hooks and wrapped forward stay; it compiles at its first call, inside whatever the strategy has wrapped around it
    by then), as torchtitan does: the blocks share one code, so one compiled graph serves them all. Graph breaks are
    allowed (a context split's gathers, a strategy's hooks run between graphs). A second shape (an evaluation's last
    batch, rows of another length) compiles one graph for any shape."""
    blocks = transformer_blocks(model)
    if not blocks:
        raise ConfigError(f"parallel.compile = {backend!r}: {type(model).__name__} has no repeated blocks (an "
                          "nn.ModuleList) to compile one by one; compile it yourself, or parallel.compile = \"\"")
    for block in blocks:
        block.compile(backend=backend)
