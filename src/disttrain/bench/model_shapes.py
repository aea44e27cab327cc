"""The models the scale model prices, as arithmetic (no torch): a model's FSDP units (the root, then each block) with
their parameters, trained parameters and FLOPs per token, its trained tensors' sizes and rows (DDP's buckets,
PowerSGD's factors); the reference GPT in closed form and the presets `--model` names (Llama 3 8B / 70B, ResNet-50,
BERT-large). A config's model is counted from its module tree instead (`predict_job.counted_shape`)."""

from __future__ import annotations

from dataclasses import dataclass

from disttrain.bench.interconnect import ITEMSIZE


@dataclass(frozen=True)
class UnitShape:
    """One FSDP unit of a model: what lies outside the transformer blocks (the root: embeddings, final norm, head),
    or one block."""

    params: float
    trained: float
    """Parameters with a gradient: the others (model.freeze) are gathered but never reduced."""
    forward_flops: float
    backward_flops: float
    """Per token; 0 where no gradient reaches the unit (frozen blocks before the first trained parameter). Where a
    model's FLOPs are not known, its parameters stand in for them (a share of the step is all they give)."""


@dataclass(frozen=True)
class ModelShape:
    name: str
    params: float
    """All parameters (what is gathered)."""
    layer_params: float = 0.0
    """Parameters of one transformer block: the FSDP unit. The rest (embeddings, head) is the root unit."""
    n_layer: int = 0
    d_model: int = 0
    seq_len: int = 0
    matmul_params: float = 0.0
    """Parameters used in matrix multiplies (6 FLOPs per token each); 0 and nothing `counted` = FLOPs unknown: give
    the compute time."""
    counted: tuple[UnitShape, ...] = ()
    """The units as counted from a model's module tree (`bench predict` with a config: `perf.flops_by_unit`, frozen
    parameters and all); empty: every parameter trained, the FLOPs from the formula, forward a third of each unit's."""
    grad_tensors: tuple[int, ...] = ()
    """Elements of each trained parameter in registration order (counted models): DDP fills a bucket with whole
    tensors. Empty: the gradients split evenly into buckets."""
    grad_rows: tuple[int, ...] = ()
    """Rows of each of those gradients as PowerSGD views it (its first dimension; 0 for a vector, which it sends
    whole). Empty: PowerSGD's factors cannot be counted."""
    vocab: int = 0
    """Vocabulary size (a preset's logits, gathered whole by a tensor split under a pipeline)."""
    columns: int = 0
    """Column-wise split linears of a block under disttrain's tensor plan (a Llama's q, k, v, gate and up: 5), for
    `tensor_calls`; 0: no plan (a counted model's collectives are recorded instead)."""
    kv_width: int = 0
    """Width of one block's keys (and values): heads x head size, the key-value heads' only under grouped-query
    attention (a Llama 3's 1/8 of d_model); what a context split gathers. 0: not known."""

    @property
    def root_params(self) -> float:
        return self.params - self.n_layer * self.layer_params

    @property
    def trained_params(self) -> float:
        return sum(u.trained for u in self.units())

    def flops_per_token(self) -> float:
        """6 x params + 12 x layers x d_model x seq (forward + backward, attention scores included), or the sum of the
        counted units'."""
        if self.counted:
            return sum(u.forward_flops + u.backward_flops for u in self.counted)
        return 6 * self.matmul_params + 12 * self.n_layer * self.d_model * self.seq_len

    def units(self) -> list[UnitShape]:
        """The root unit, then each block (one unit without blocks). Uncounted, each unit's FLOPs by the formula when
        known (a block: 6 x its parameters + its attention, the root the rest), else its parameters."""
        if self.counted:
            return list(self.counted)
        if self.n_layer == 0:
            return [UnitShape(self.params, self.params, self.params / 3, 2 * self.params / 3)]
        total = self.flops_per_token() if self.matmul_params else self.params
        block = (6 * self.layer_params + 12 * self.d_model * self.seq_len if self.matmul_params
                 else self.layer_params)
        root = max(0.0, total - self.n_layer * block)
        return ([UnitShape(self.root_params, self.root_params, root / 3, 2 * root / 3)]
                + [UnitShape(self.layer_params, self.layer_params, block / 3, 2 * block / 3)] * self.n_layer)


def joined(name: str, roots: list[UnitShape], blocks: list[UnitShape], seq_len: int) -> ModelShape:
    """A model of `blocks` after one root unit holding what `roots` hold (a pipeline stage's embedding or head, a
    rank's stages together; none: an empty root)."""
    root = UnitShape(sum(u.params for u in roots), sum(u.trained for u in roots), sum(u.forward_flops for u in roots),
                     sum(u.backward_flops for u in roots))
    return ModelShape(name, root.params + sum(u.params for u in blocks), blocks[0].params if blocks else 0.0,
                      len(blocks), seq_len=seq_len, counted=(root, *blocks))


def gpt_shape(n_layer: int, d_model: int, seq_len: int, vocab_size: int) -> ModelShape:
    """disttrain's reference GPT (models/gpt.py) in closed form: tied embeddings, learned positions, biased linears.
    (`bench predict` counts a config's model instead, `predict_job.counted_shape`; this form keeps the scale model's
    own tests free of torch, and checks that count.)"""
    layer = 12 * d_model**2 + 13 * d_model
    rest = vocab_size * d_model + seq_len * d_model + 2 * d_model
    return ModelShape(f"gpt {n_layer}x{d_model}", n_layer * layer + rest, layer, n_layer, d_model, seq_len,
                      n_layer * 12 * d_model**2 + vocab_size * d_model, kv_width=d_model)


def llama_shape(name, layers, d, ffn, kv_heads, heads, vocab, seq):
    layer = 2 * d * d + 2 * d * (d * kv_heads // heads) + 3 * d * ffn + 2 * d
    matmul = layers * (layer - 2 * d) + vocab * d  # the output head multiplies; the input embedding is a lookup
    return ModelShape(name, layers * layer + 2 * vocab * d + d, layer, layers, d, seq, matmul, vocab=vocab,
                      columns=5, kv_width=d * kv_heads // heads)


def tensor_calls(model: ModelShape, stored: str, compute: str, sequence_parallel: bool, clip: bool = True, *,
                 stream: str = "", blocks: int | None = None, first: bool = True, last: bool = True,
                 split_logits: bool = True, recompute: bool = False) -> tuple[tuple[str, str, float, str], ...]:
    """(part, collective, bytes, dtype) of one sequence's tensor-split collectives for a preset, in closed form: what
    `bench/tensor_calls.count` records of a Llama under disttrain's plan, the calls of seq x d_model elements.

    The residual stream's calls travel in `stream` (default `stored`: the parameters' dtype, which FSDP2's gathered
    copies make the compute dtype): the embedding's output all-reduced, the gradients of the column-wise inputs; a
    block's row-wise outputs in the `compute` dtype (autocast). Without sequence parallelism: forward one
    all-reduce per row-wise linear, backward one per column-wise linear (and the head's input); with it, each
    all-reduce is an all-gather and a reduce-scatter, and the backward gathers once per attention and MLP input.
    The logits: split by vocabulary (`split_logits`, loss parallel: three all-reduces of a float32 a token in
    forward), else gathered whole in the compute dtype. Once a step (part "step", its sizes not a sequence's, in
    `stored`): the norm of the clipped gradients (`clip`) all-reduces the column-wise shards' norms and the
    row-wise ones', and under sequence parallelism each norm's weight gradient, left partial by backward, is summed
    where read: by the clip and by the optimizer.

    A pipeline stage's (`blocks` of the model's blocks, the embedding where `first`, the final norm and head where
    `last`): the whole model's by default. `recompute` (activation checkpointing): each block's forward calls are
    sent again in backward, but its last."""
    b, f, z = model.n_layer if blocks is None else blocks, int(first), int(last)
    size, stream = model.seq_len * model.d_model, stream or stored
    s, c, r = ITEMSIZE[stored], ITEMSIZE[compute], ITEMSIZE[stream]
    step = (("step", "all_reduce", (model.columns * b + z) * s, stored),
            ("step", "all_reduce", 2 * b * s, stored)) if clip else ()
    logits = ((("forward", "all_reduce", model.seq_len * 4, "float32"),) * 3 if split_logits  # (the loss's)
              else (("forward", "all_gather", model.seq_len * model.vocab * c, compute),)) * z
    ends = logits + (("forward", "all_reduce", size * r, stream),) * f  # (the embedding's output)
    if not sequence_parallel:
        block = (("all_reduce", size * c, compute),) * 2
        return (step + ends + _blocks(block, b, recompute)
                + (("backward", "all_reduce", size * r, stream),) * (model.columns * b + z))
    step += (("step", "all_reduce", model.d_model * s, stored),) * (2 * b + z) * (1 + clip)
    block = (("all_gather", size * r, stream), ("reduce_scatter", size * c, compute)) * 2
    return (step + ends + _blocks(block, b, recompute) + (("forward", "all_gather", size * r, stream),) * z
            + (("backward", "reduce_scatter", size * r, stream),) * (2 * b + z)
            + (("backward", "all_gather", size * c, compute),) * 2 * b
            + (("backward", "all_gather", size * r, stream),) * f)


def _blocks(block: tuple, blocks: int, recompute: bool) -> tuple:
    """`blocks` blocks' forward calls (each `block`'s: collective, bytes, dtype, in order), and where recomputed in
    backward again but the block's last: torch's checkpoint stops recomputing once it has what backward saved, and
    the block's output is not among it."""
    again = (("backward", *call) for call in block[:-1]) if recompute else ()
    return (tuple(("forward", *call) for call in block) + tuple(again)) * blocks


MODELS: dict[str, ModelShape] = {
    "llama3-8b": llama_shape("llama3-8b", 32, 4096, 14336, 8, 32, 128256, 8192),
    "llama3-70b": llama_shape("llama3-70b", 80, 8192, 28672, 8, 64, 128256, 8192),
    "llama3-405b": llama_shape("llama3-405b", 126, 16384, 53248, 8, 128, 128256, 8192),
    "resnet50": ModelShape("resnet50", 25.6e6),
    "bert-large": ModelShape("bert-large", 340e6, 12.6e6, 24, 1024, 128, 24 * 12.6e6),
}
