"""Tensor parallelism: each transformer block's attention and MLP split across the ranks of the mesh's `tp` axis
with DTensor's `parallelize_module` (Megatron style: q, k, v and the MLP's first matrices column-wise, the output
projections row-wise, so a block needs one all-reduce forward and one backward).

`parallel.sequence_parallel` also splits the residual stream along the sequence between those matrices: the norms
run on a rank's part of the sequence, and the all-reduce becomes an all-gather before and a reduce-scatter after.
The numbers are the same either way (fp32: to rounding).

The plans are written against module names: the reference GPT (models/gpt.py) and Hugging Face Llama-family
models (LlamaForCausalLM and the families that share its module names: Mistral, Qwen2, Qwen3, ...). The token
embedding is split by vocabulary rows and the LM head by vocabulary columns; tied weights stay tied.

Loss parallel (`parallel.loss_parallel`; `auto`: for vocabularies of `SPLIT_LOGITS_FROM` tokens and more, without a
pipeline): the head's logits stay split by
vocabulary, and disttrain's own cross-entropy (losses.py) runs on them under torch's `loss_parallel()`: each rank
computes its part of the log-softmax, with two small all-reduces per micro-batch (max and sum of exponentials, one
value per token), instead of gathering micro-batch x seq_len x vocabulary logits and keeping them for backward.
Anything that expects whole logits (a user's loss function, `forward()`, evaluation) gets them gathered (`whole`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from disttrain.errors import ConfigError
from disttrain.parallel.activation_checkpoint import transformer_blocks
from disttrain.parallel.stages import SEQUENCE_SHARDS
from disttrain.parallel.state import tie_groups

# Per model family: names inside one block. `attention`/`mlp` are the submodules whose input is gathered under
# sequence parallelism; `column`/`row` the linear layers split column-wise / row-wise; `norms` the block's norms.
FAMILIES = {
    "gpt": {"attention": "attn", "mlp": "mlp", "column": ("attn.q", "attn.k", "attn.v", "mlp.0"),
            "row": ("attn.proj", "mlp.2"), "norms": ("ln1", "ln2"), "heads": "n_head"},
    "llama": {"attention": "self_attn", "mlp": "mlp",
              "column": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
              "row": ("self_attn.o_proj", "mlp.down_proj"), "norms": ("input_layernorm", "post_attention_layernorm"),
              "heads": "num_key_value_heads"},
}


def family(model: nn.Module) -> str:
    """Which plan fits `model` (by the names in its first block); a one-line error when none does."""
    blocks = transformer_blocks(model)
    names = {name for name, _ in blocks[0].named_modules()} if blocks else set()
    for name, plan in FAMILIES.items():
        if set(plan["column"]) | set(plan["row"]) <= names:
            return name
    raise ConfigError(f"parallel.tensor > 1: no tensor-parallel plan fits {type(model).__name__} (plans exist for "
                      "the reference GPT and Hugging Face Llama-family models: q/k/v/o_proj, gate/up/down_proj); "
                      "set parallel.tensor = 1 and use fsdp to shard it")


def vocabulary(model: nn.Module) -> int:
    return _embedding(model).num_embeddings


def hidden_size(model: nn.Module) -> int:
    """Width of the residual stream (the token embedding's)."""
    return _embedding(model).embedding_dim


def _embedding(model: nn.Module) -> nn.Embedding:
    return model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else model.tok_emb


def check_divisible(model: nn.Module, kind: str, degree: int) -> None:
    """Heads and vocabulary split evenly across `degree` ranks, or a one-line error naming the model's size."""
    config = getattr(model, "config", None) or getattr(model, "cfg", None)
    heads = getattr(config, FAMILIES[kind]["heads"], None) or getattr(config, "num_attention_heads", None)
    for what, value in (("attention heads", heads), ("vocabulary size", vocabulary(model))):
        if value is not None and value % degree:
            raise ConfigError(f"parallel.tensor = {degree} does not divide the model's {what} ({value}); choose a "
                              f"tensor degree that divides {value}")


SPLIT_LOGITS_FROM = 8192
"""`parallel.loss_parallel = auto` splits the logits of vocabularies this large and larger."""


def splits_logits(parallel, layout, vocab: int) -> bool:
    """Whether the head's logits stay split by vocabulary (loss parallel): a tensor-parallel layout without a
    pipeline (a pipeline's last stage hands its output to the schedule, which wants plain tensors), when asked
    for or, under `auto`, for a vocabulary of `SPLIT_LOGITS_FROM` or more."""
    if layout.tensor == 1 or layout.pipeline > 1 or parallel.loss_parallel == "false":
        return False
    return parallel.loss_parallel == "true" or vocab >= SPLIT_LOGITS_FROM


def parallelize(model: nn.Module, tp_mesh, sequence_parallel: bool, split_logits: bool = False) -> None:
    """Split `model`'s blocks, embedding and head across `tp_mesh` in place (parameters become DTensors); with
    `split_logits` the head returns its logits as a DTensor split by vocabulary (loss parallel)."""
    kind = family(model)
    check_divisible(model, kind, tp_mesh.size())
    plan = FAMILIES[kind]
    ties = tie_groups(model)
    seq = Shard(1)
    block_plan = {name: ColwiseParallel() for name in plan["column"]}
    block_plan.update({name: RowwiseParallel(output_layouts=seq if sequence_parallel else Replicate())
                       for name in plan["row"]})
    if sequence_parallel:
        block_plan.update({name: SequenceParallel() for name in plan["norms"]})
        block_plan[plan["attention"]] = PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": seq}, desired_input_kwarg_layouts={"hidden_states": Replicate()}
        ) if kind == "llama" else PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
        block_plan[plan["mlp"]] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    blocks = transformer_blocks(model)
    shards = tp_mesh.size() if sequence_parallel else 1
    setattr(model, SEQUENCE_SHARDS, shards)
    for i, block in enumerate(blocks):  # (a Llama's stream is split on entering its first block: see _outer_plan)
        setattr(block, SEQUENCE_SHARDS, 1 if i == 0 and kind == "llama" else shards)
    for block in blocks:
        parallelize_module(block, tp_mesh, block_plan)
    parallelize_module(model, tp_mesh, _outer_plan(model, kind, sequence_parallel, blocks, split_logits))
    _retie(model, ties)
    # torch's SequenceParallel re-registers the norms' parameters as trainable: model.freeze's stay frozen
    for name, param in model.named_parameters(remove_duplicate=False):
        if name in frozen:
            param.requires_grad_(False)
    whole = [m for m in model.modules() if any(not isinstance(p, DTensor) for p in m.parameters(recurse=False))]
    for module in whole:  # positions, and the norms when the sequence is not split
        Replicated()._apply(module, tp_mesh)


class Replicated(ParallelStyle):
    """A module left whole on every tensor-parallel rank, with its parameters as replicated DTensors (so that
    every parameter is a DTensor on the mesh, as optimizers' multi-tensor kernels, gradient norms and checkpoints
    want): inputs enter as replicated DTensors and outputs leave as plain tensors. No communication."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def inputs(_, args, mesh):
            return tuple(DTensor.from_local(a, mesh, [Replicate()], run_check=False)
                         if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) else a for a in args)

        def outputs(_, out, mesh):
            return out.to_local() if isinstance(out, DTensor) else out

        return distribute_module(module, device_mesh, None, input_fn=inputs, output_fn=outputs)


def _outer_plan(model: nn.Module, kind: str, sequence_parallel: bool, blocks: list[nn.Module],
                split_logits: bool) -> dict:
    """Embedding (vocabulary rows), the sequence split before the first block, the final norm and the head."""
    names = {module: name for name, module in model.named_modules()}
    embedding = names[model.get_input_embeddings()] if hasattr(model, "get_input_embeddings") else "tok_emb"
    head = "lm_head"
    seq = Shard(1)
    plan = {embedding: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            head: ColwiseParallel(input_layouts=seq if sequence_parallel else Replicate(),
                                  output_layouts=Shard(-1) if split_logits else Replicate(),
                                  use_local_output=not split_logits)}
    if sequence_parallel:
        # the stream is split along the sequence where the blocks start (the GPT adds positions first; a Llama's
        # rotary embedding and mask are computed from the full sequence before its first layer)
        start = "drop" if kind == "gpt" else names[blocks[0]]
        plan[start] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(seq,),
                                         use_local_output=True)
        plan["ln_f" if kind == "gpt" else names[_final_norm(model)]] = SequenceParallel()
    return plan


def _final_norm(model: nn.Module) -> nn.Module:
    return model.model.norm


def _retie(model: nn.Module, ties: list[list[str]]) -> None:
    """Tied parameters (e.g. embedding and head) were replaced one module at a time: point every name at one
    DTensor again (both are split by vocabulary rows, so the placements agree)."""
    for group in ties:
        first = model.get_parameter(group[0])
        for name in group[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, first)


class LossParallel:
    """torch's `loss_parallel()` (cross-entropy on logits split by vocabulary), as a context entered once however
    deeply it is nested: the backward needs it as much as the forward, so the step enters it around forward, loss
    and backward, and the loss enters it again on its own (torch's context cannot nest: leaving the inner one would
    switch it off for the backward)."""

    def __init__(self) -> None:
        self._depth = 0
        self._context = None

    def __enter__(self) -> None:
        if self._depth == 0:
            self._context = loss_parallel()
            self._context.__enter__()
        self._depth += 1

    def __exit__(self, *exc) -> bool:
        self._depth -= 1
        if self._depth == 0:  # (torch's context has no finally: leave it normally even after an error)
            self._context.__exit__(None, None, None)
        return False

    @staticmethod
    def whole(outputs):
        return whole(outputs)


def whole(outputs):
    """Model outputs with split logits gathered (a tensor, or the `logits` of an HF output / dict, or a tuple's
    first item): what a user's loss function and a caller of `forward()` expect."""
    if isinstance(outputs, DTensor):
        return outputs.full_tensor()
    if isinstance(outputs, dict) and isinstance(outputs.get("logits"), DTensor):  # HF ModelOutput is a dict too
        outputs["logits"] = outputs["logits"].full_tensor()
        return outputs
    if isinstance(outputs, (tuple, list)) and outputs and isinstance(outputs[0], DTensor):
        return type(outputs)([outputs[0].full_tensor(), *outputs[1:]])
    return outputs
