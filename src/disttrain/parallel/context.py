"""Context parallelism: each sequence is cut into `parallel.context` consecutive chunks, one per rank of the `cp`
axis, so that a rank holds the activations of its chunk only (for sequences too long for one device).

Everything but attention is per token and runs on the chunk as it is. Attention needs the keys and values of every
earlier position: each attention gathers them from the chunk's group (`_Gather`, whose backward sums every rank's
gradient for a chunk back to its owner) and attends with a causal mask offset by the chunk's start.
The model's attention modules take it as their `attention_fn` (the reference GPT calls torch's
`scaled_dot_product_attention` through it), and a Hugging Face model's through transformers' attention interface
(`HF_ATTENTION`), so an activation-checkpointed block's recompute attends the same way.
(torch's own `context_parallel` swaps SDPA on CUDA; its CPU SDPA has no sharding rule for it, and it fails on gloo.)
The model's positions (the GPT's position embedding, a Llama's rotary embedding) read the chunk's `position_ids`.
Hugging Face's labels (aligned with the inputs, shifted by the loss) are shifted before the cut (the backend).

The rest composes as a data axis does: the ranks of a chunk group read the same samples, each counts the loss of
its own tokens (the step's totals are summed over every rank, as over data ranks), and the gradients are reduced
over data x context ranks (parallel/mesh.py folds `cp` into the data axis of the DeviceMesh).

Chunks are consecutive, so rank 0 attends to the fewest keys (no load balancing yet).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from disttrain.errors import ConfigError


class ContextParallel:
    """This rank's chunk of every sequence (`shard`), the attention over the whole sequence (`attend`), and the
    outputs of the whole sequence (`whole`)."""

    def __init__(self, group, size: int, rank: int):
        self.group, self.size, self.rank = group, size, rank

    def parallelize(self, model: nn.Module) -> None:
        """Give every attention of `model` this rank's: a Hugging Face model's through transformers' attention
        interface (`HF_ATTENTION`), another's attention modules through their `attention_fn` (the reference GPT)."""
        if hasattr(model, "set_attn_implementation"):
            from transformers import AttentionInterface, AttentionMaskInterface

            AttentionInterface.register(HF_ATTENTION, _hf_attention)
            AttentionMaskInterface.register(HF_ATTENTION, _no_mask)  # (the chunk's own causal mask is `attend`'s)
            for module in model.modules():
                module._disttrain_context = self
            model.set_attn_implementation(HF_ATTENTION)
            return
        modules = [m for m in model.modules() if hasattr(m, "attention_fn")]
        if not modules:
            raise ConfigError("parallel.context > 1 needs attention modules with an `attention_fn` (the reference "
                              "GPT's) or a Hugging Face model; this model has neither")
        for module in modules:
            module.attention_fn = self.attend

    def shard(self, batch: Any) -> Any:
        """This rank's chunk of every sequence-valued tensor of a dict batch (dim 1, the sequence), with the chunk's
        `position_ids`; other values as they are."""
        if not isinstance(batch, dict) or not isinstance(batch.get("input_ids"), torch.Tensor):
            raise ConfigError("parallel.context > 1 cuts sequences by their 'input_ids': give dict batches with "
                              "'input_ids' (and 'labels')")
        from disttrain.parallel.pipeline import check_mask

        check_mask(batch, "parallel.context")  # (the whole sequence's: its chunks attend without a mask)
        width = batch["input_ids"].shape[1]
        if width % self.size:
            raise ConfigError(f"parallel.context = {self.size}: a batch of {width} tokens per sequence cannot be cut "
                              "into equal chunks; make every sequence a multiple of parallel.context long")
        chunk = width // self.size
        start = self.rank * chunk
        out = {key: value[:, start:start + chunk] if _is_sequence(value, width) else value
               for key, value in batch.items()}
        if "position_ids" not in out:
            positions = torch.arange(start, start + chunk, device=batch["input_ids"].device)
            out["position_ids"] = positions.expand(batch["input_ids"].shape[0], chunk)
        return out

    def whole(self, outputs: Any) -> Any:
        """The logits of every chunk, joined along the sequence (for evaluation and `forward()`): a tensor, or the
        `logits` of a Hugging Face output (in place)."""
        if isinstance(outputs, dict) and isinstance(outputs.get("logits"), torch.Tensor):
            outputs["logits"] = self.whole(outputs["logits"])
            return outputs
        if not isinstance(outputs, torch.Tensor):
            raise ConfigError(f"parallel.context > 1 joins the chunks' logits, and the model returned "
                              f"{type(outputs).__name__}; return logits (or an output with a `logits` field)")
        parts = [torch.empty_like(outputs) for _ in range(self.size)]
        dist.all_gather(parts, outputs.contiguous(), group=self.group)
        return torch.cat(parts, dim=1)

    def attend(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        """Causal attention of this chunk's queries over the keys and values of the whole sequence."""
        if attn_mask is not None or not is_causal:
            raise ConfigError("parallel.context > 1 runs causal attention without a mask only (no padding mask, "
                              "no bidirectional attention)")
        keys = _Gather.apply(k, self.group, self.size, self.rank)
        values = _Gather.apply(v, self.group, self.size, self.rank)
        if enable_gqa and keys.shape[-3] != q.shape[-3]:  # grouped keys and values: one per group of query heads
            keys, values = (t.repeat_interleave(q.shape[-3] // t.shape[-3], dim=-3) for t in (keys, values))
        chunk = q.shape[-2]
        mine = torch.arange(self.rank * chunk, (self.rank + 1) * chunk, device=q.device)
        mask = torch.arange(keys.shape[-2], device=q.device)[None, :] <= mine[:, None]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, dropout_p=dropout_p, scale=scale)


HF_ATTENTION = "disttrain_context"
"""The name a Hugging Face model's attention runs under (transformers' AttentionInterface)."""


def _hf_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                  **kwargs):
    """transformers' attention-function signature: (batch, heads, chunk, dim) in, (batch, chunk, heads, dim) out."""
    out = module._disttrain_context.attend(query, key, value, is_causal=True, dropout_p=dropout, scale=scaling,
                                           enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs) -> None:
    return None


class _Gather(torch.autograd.Function):
    """The chunks of the group, joined along the sequence (dim -2); backward: the sum of every rank's gradient for
    this rank's chunk. (torch.distributed.nn.functional.all_gather's backward on gloo scatters from group ranks as if
    they were global ones, which fails on any group but the first.)"""

    @staticmethod
    def forward(ctx, chunk: torch.Tensor, group, size: int, rank: int) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.width = group, rank, chunk.shape[-2]
        parts = [torch.empty_like(chunk, memory_format=torch.contiguous_format) for _ in range(size)]
        dist.all_gather(parts, chunk.contiguous(), group=group)
        return torch.cat(parts, dim=-2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.narrow(-2, ctx.rank * ctx.width, ctx.width), None, None, None


def _is_sequence(value: Any, width: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == width
