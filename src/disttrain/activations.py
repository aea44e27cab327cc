"""Activations: the bytes autograd keeps for backward after one micro-batch's forward, counted op by op for the
models the memory estimator knows (the reference GPT on any layout, Llama-family HF models in fp32), and what
frozen parameters (model.freeze) spare. Exact in fp32 on CPU (tests/test_memory.py, tests/test_hf.py)."""

from __future__ import annotations

import dataclasses
import json
from typing import NamedTuple

from torch import nn

from disttrain.config import Config, ModelConfig
from disttrain.parallel import placement, tensor
from disttrain.parallel.activation_checkpoint import leading_frozen_blocks
from disttrain.parallel.mesh import MeshLayout, stage_count
from disttrain.parallel.stages import FAMILIES, family_of, stage_bounds


class Spared(NamedTuple):
    """The activations that frozen parameters (model.freeze) spare (`spared_by_freeze`)."""
    blocks: int = 0
    """Leading transformer blocks that keep nothing."""
    embeds: bool = False
    """The embeddings keep nothing (not the token ids)."""
    head: bool = False
    """The output projection keeps no input."""


NOTHING_SPARED = Spared()


def gpt_activation_bytes(m: ModelConfig, micro_batch: int, checkpointing: bool, precision: str = "fp32",
                         linears: str = "autocast", *, tensor: int = 1, sequence_parallel: bool = False,
                         split_logits: bool = False,
                         blocks: int | None = None, embeds: bool = True, head: bool = True, ids: bool = True,
                         spared: Spared = NOTHING_SPARED) -> int:
    """Bytes autograd keeps for backward after the forward of one micro-batch of the reference GPT (or of a
    pipeline stage of it: `blocks` blocks, with the embedding if `embeds` and ln_f, the head and the loss if
    `head`; `ids`: with the token ids the embedding saves, which a pipeline keeps for the whole step apart;
    `spared`: what frozen parameters spare, its `blocks` where `blocks` is not given).

    Per block and token: LayerNorm inputs and their mean/rstd (in the residual stream's dtype: float32, or
    bfloat16 under bf16-true), LayerNorm outputs (2 x d), the q, k and v outputs (3 d), the
    attention output (d; the projection's input is a view of it), the MLP hidden before and after GELU
    (2 x 4 d) -- in the activation dtype (16-bit under mixed precision and bf16-true) -- and the attention
    logsumexp (h, float32). Outside the blocks: ln_f's input, statistics and output, the float32
    log-softmax of the logits (V), the token ids and targets (int64), positions and the loss's total weight
    (fp16-mixed: and the loss scale). With checkpointing a block keeps only its input (the residual stream).

    Under mixed precision what the linear layers keep depends on who casts the weights (`linears`):
    "autocast"   autocast casts them: the 16-bit copies are saved (12 d^2 per block, V d for the lm_head), and
                 it casts the input of each linear on its own (ln1's output three times, for q, k and v);
    "gathered16" FSDP2's MixedPrecisionPolicy gathers them in 16 bits and casts the forward's inputs: no
                 copies, and the residual stream runs in 16 bits too (the layout of bf16-true);
    "zero3"      DeepSpeed ZeRO-3's memory-efficient linear (it replaces torch.nn.functional.linear) saves
                 the parameter, not a copy, and its input as it comes: LayerNorm outputs stay float32.

    Tensor parallelism over `tensor` ranks (measured exact in fp32 on CPU) splits what the column-wise linears
    make: q, k, v, the attention output and its logsumexp (heads), the MLP hidden before and after GELU; the norms'
    inputs, statistics and outputs, the log-softmax (unless `split_logits`: loss parallel keeps each rank's
    part of the vocabulary) and the ids stay whole. With
    `sequence_parallel` the norms' inputs and statistics (and a checkpointed block's input) are split along the
    sequence too, but their outputs are not: the linears save the all-gathered input.
    """
    b, t, d, h, v = micro_batch, m.seq_len, m.d_model, m.n_head, m.vocab_size
    n = m.n_layer - spared.blocks if blocks is None else blocks
    embeds = embeds and not spared.embeds
    tp, sp = tensor, tensor if sequence_parallel else 1
    mixed = precision in ("bf16-mixed", "fp16-mixed")
    act = 4 if precision == "fp32" else 2  # activations
    res = 2 if precision == "bf16-true" or (mixed and linears == "gathered16") else 4  # residual stream, LN
    ln_out = res if mixed and linears == "zero3" else act  # LayerNorm outputs, as the next linear saves them
    copies = 2 if mixed and linears == "autocast" else 0  # bytes per weight element autocast saves
    # autocast casts ln1's output once for each of q, k and v, and each keeps its own copy: 2 more than one linear
    recasts = 2 * act * d if mixed and linears == "autocast" else 0
    # per block: (bytes per token split along the sequence under sp, whole, split by tensor parallelism)
    if checkpointing:
        block = (res * d, 0, 0)
    else:
        block = (2 * res * d + 4 * res, 2 * ln_out * d + recasts, 12 * act * d // tp + 4 * h // tp)
    total = n * (b * t // sp * block[0] + b * t * (block[1] + block[2]))
    if embeds:  # the token ids and the positions the embeddings save
        total += (8 * b * t if ids else 0) + 8 * t
    if head:  # ln_f, the float32 log-softmax, the int64 targets, the loss's total weight (fp16: and its scale)
        total += b * t // sp * (res * d + 2 * res) + 4
        total += b * t * (ln_out * d * (not spared.head) + 4 * v // (tp if split_logits else 1) + 8)
        total += 4 if precision == "fp16-mixed" else 0
    weights = ((0 if checkpointing else n * 12 * d * d) + (v * d if head else 0)) * copies // tp
    return total + weights


LLAMA_FAMILY = ("llama", "mistral", "qwen2")
"""Hugging Face `model_type`s with Llama's layer (RMSNorm, rotary attention with grouped KV heads, SwiGLU MLP)."""


def llama_activation_bytes(hf: dict, micro_batch: int, seq_len: int, checkpointing: bool,
                           spared: Spared = NOTHING_SPARED) -> int:
    """Bytes autograd keeps for backward after the forward of one micro-batch of a Llama-family HF model (fp32, SDPA
    attention on CPU or a fused kernel, unpadded batch), counted op by op for transformers' implementation.

    Per layer and token: each RMSNorm keeps its input, the normalised tensor, its output (3 d) and the rstd (1);
    attention keeps q after rotary (d), k and v (2 x kv_heads x head_dim), SDPA's logsumexp (heads) and the output
    projection's input (d); the MLP keeps gate, SiLU(gate), up and the down projection's input (4 x intermediate).
    Outside: token ids, the rotary cos/sin (t x head_dim each, shared by the layers), the final norm and the
    float32 log-softmax over the vocabulary of the t - 1 shifted positions with their int64 targets. With
    checkpointing a layer keeps only its input (and cos/sin are recomputed). `spared`: what frozen parameters spare."""
    b, t, d, n = micro_batch, seq_len, hf["hidden_size"], hf["num_hidden_layers"] - spared.blocks
    heads = hf["num_attention_heads"]
    kv, head_dim = hf.get("num_key_value_heads") or heads, hf.get("head_dim") or d // heads
    inter, vocab = hf["intermediate_size"], hf["vocab_size"]
    if checkpointing:
        layer, rotary = 4 * d, 0
    else:
        layer = 4 * (3 * d + 1) * 2 + 4 * (d + 2 * kv * head_dim + d) + 4 * heads + 4 * 4 * inter
        rotary = 2 * 4 * t * head_dim
    norm = 4 * (2 * d + 1 + d * (not spared.head))  # (a frozen lm_head keeps no input)
    outside = 8 * b * t * (not spared.embeds) + rotary + b * t * norm + b * (t - 1) * (4 * vocab + 8) + 4
    # the first trained layer's input needs no gradient (frozen embeddings and layers before it): its first RMSNorm
    # keeps neither that input (pow's) nor the rstd (the product's), only the normalised tensor (measured)
    first = 4 * (d + 1) if spared.embeds and n and not checkpointing else 0
    return b * t * (n * layer - first) + outside


def spared_by_freeze(model: nn.Module, linears: str) -> Spared:
    """Autograd saves nothing for frozen embeddings and the frozen blocks before the first trained parameter
    (`leading_frozen_blocks`), and a frozen head keeps no input (measured; but DeepSpeed ZeRO-3's linear,
    `linears == "zero3"`, keeps it). A frozen block after a trained one still passes gradients back: counted in
    full, an upper bound."""
    if all(p.requires_grad for p in model.parameters()):
        return NOTHING_SPARED
    head = model.get_submodule(FAMILIES[family_of(model)].head[-1])
    skip = leading_frozen_blocks(model)
    head_frozen = not any(p.requires_grad for p in head.parameters())
    return Spared(skip or 0, skip is not None, head_frozen and linears != "zero3")


def activations(cfg: Config, linears: str, model: nn.Module, mesh: MeshLayout | None = None,
                stage_rank: int = 0) -> tuple[int | None, int | None, list[str]]:
    """(activations, with checkpointing, notes) for the models the estimator knows: the reference GPT (on any
    layout), and Llama-family HF models in fp32 (model not split); `model` built on the meta device, `linears` what
    the strategy's linear layers save (parallel/layout.py)."""
    precision, micro = cfg.parallel.precision, cfg.data.micro_batch_size
    notes = []
    if not all(p.requires_grad for p in model.parameters()):
        notes.append("frozen parameters: the frozen embeddings and blocks before the first trained one keep no "
                     "activations, a frozen head keeps no input; other frozen blocks are counted in full (an upper "
                     "bound)")
    if mesh is not None and cfg.model.name == "gpt":
        acts, acts_ac, split_notes = _gpt_split_activations(cfg, linears, mesh, model, stage_rank)
        return acts, acts_ac, split_notes + notes
    if mesh is not None:
        return None, None, ["activations under parallel.pipeline / parallel.tensor are estimated for the reference "
                            "GPT only; measure your model instead (`disttrain bench memory`)"]
    if cfg.model.name == "gpt":
        spared = spared_by_freeze(model, linears)
        acts, acts_ac = (gpt_activation_bytes(cfg.model, micro, ac, precision, linears, spared=spared)
                         for ac in (False, True))
        if precision in ("bf16-mixed", "fp16-mixed") and linears == "autocast":
            notes.append("activations include the 16-bit weight copies autocast saves for backward")
        return acts, acts_ac, notes
    if cfg.model.name.startswith("hf:"):
        from disttrain.models.hf import hf_directory

        hf = json.loads((hf_directory(cfg.model.name) / "config.json").read_text())
        if hf.get("model_type") in LLAMA_FAMILY and precision == "fp32":
            spared = spared_by_freeze(model, linears)
            acts, acts_ac = (llama_activation_bytes(hf, micro, cfg.model.seq_len, ac, spared) for ac in (False, True))
            return acts, acts_ac, notes
        return None, None, [f"activations are estimated for Llama-family HF models ({', '.join(LLAMA_FAMILY)}) in "
                            "fp32 only; measure your model instead (`disttrain bench memory`)"]
    return None, None, ["activations are estimated for the reference GPT and Llama-family HF models only; "
                        "measure your model instead"]


def _gathered_kv(m: ModelConfig, micro_batch: int, context: int, precision: str, tensor: int = 1) -> int:
    """What one block's attention keeps beyond its share under context parallelism (parallel/context.py): the keys
    and values of the whole sequence where its own would be (gathered in the sequence's order; each of its two
    pieces reads them up to the piece's end, a view), and the causal masks of its two pieces' queries over them, h x
    (r + 1) h and h x (2c - r) h for pieces of h tokens (CPU's SDPA materialises each as an additive mask in the
    activations' dtype): h^2 (2c + 1) on every rank but 0, whose first piece's square needs none; and the attention's
    output twice (SDPA keeps each piece's for its backward, the projection the two joined). Under a tensor split each
    rank's keys, values and outputs are its heads': 1/tensor of them."""
    if context == 1:
        return 0
    t, piece = m.seq_len, m.seq_len // (2 * context)
    act = 4 if precision == "fp32" else 2
    width = m.d_model // tensor
    return (2 * act * width * micro_batch * (t - 2 * piece) + act * piece * piece * (2 * context + 1)
            + act * width * micro_batch * 2 * piece)


def _gpt_split_activations(cfg: Config, linears: str, mesh: MeshLayout, model: nn.Module,
                           stage_rank: int) -> tuple[int, int, list[str]]:
    """The reference GPT's activations on one rank of a pipeline x tensor layout: each micro-batch the schedule
    keeps in flight there (placement.in_flight) holds what its stage saves, tensor-split as gpt_activation_bytes
    says; the first stage also holds the step's token ids, one tensor that the pipeline cuts into micro-batches."""
    p, m, micro = cfg.parallel, cfg.model, cfg.data.micro_batch_size
    stages = placement.rank_stages(mesh, p, stage_rank)
    last = stage_count(p, mesh.pipeline) - 1
    bounds = stage_bounds(model, last + 1, p.pipeline_split)
    microbatches = cfg.data.global_batch_size // (mesh.data * micro) if mesh.pipeline > 1 else 1
    chunk = dataclasses.replace(m, seq_len=m.seq_len // mesh.context)  # (context parallelism: this rank's share)
    spared = spared_by_freeze(model, linears)
    trained = [max(0, high - max(low, spared.blocks)) for low, high in bounds]  # the blocks that keep activations
    out, counts, exact = [], [], True
    for ac in (False, True):
        gathered = 0 if ac else _gathered_kv(m, micro, mesh.context, p.precision, mesh.tensor)
        sizes = tuple(gathered * trained[stage] +
                      gpt_activation_bytes(chunk, micro, ac, p.precision, linears, tensor=mesh.tensor,
                                           sequence_parallel=p.sequence_parallel,
                                           split_logits=tensor.splits_logits(p, mesh, m.vocab_size),
                                           blocks=trained[stage], embeds=stage == 0, head=stage == last,
                                           ids=mesh.pipeline == 1, spared=spared)
                      for stage in stages)
        chunks, exact = placement.in_flight(p.pipeline_schedule, mesh.pipeline, stage_rank, microbatches, sizes) \
            if mesh.pipeline > 1 else ([0], True)
        counts.append(len(chunks))
        ids = 8 * microbatches * micro * chunk.seq_len  # (a pipeline's first stage keeps the step's token ids)
        out.append(sum(sizes[c] for c in chunks) + (ids if 0 in stages and not spared.embeds and mesh.pipeline > 1
                                                    else 0))
    notes = []
    if mesh.tensor > 1 and p.precision != "fp32":  # checked: fp32; bf16-mixed tp2 measured 11% below the estimate
        notes.append("activations under parallel.tensor > 1 are checked in fp32; in 16 bits they are approximate")
    if mesh.pipeline > 1:
        notes.append(f"pipeline ({p.pipeline_schedule}, {microbatches} micro-batches per step): stage rank "
                     f"{stage_rank} keeps {counts[0]} micro-batches' activations in flight")
        if not exact:
            notes.append(f"this torch does not give {p.pipeline_schedule}'s order of computations: activations "
                         "in flight are counted as interleaved-1f1b's, an approximation")
    return out[0], out[1], notes
