"""Context parallelism: each sequence is cut across the `parallel.context` ranks of the `cp` axis, so that a rank
holds the activations of its share only (for sequences too long for one device). The sequence is cut into 2c equal
pieces, and rank r takes pieces r and 2c - 1 - r (load balancing, as torchtitan's and Megatron's context parallelism
do): under causal attention a later piece attends to more keys, and each rank's pair attends to as many
query-key pairs as any other's, so no rank waits on another for its attention.

Everything but attention is per token and runs on the rank's pieces as they are. Attention needs the keys and
values of every earlier position: each attention gathers them from the group (`_Gather`, whose backward sums every
rank's gradient for a piece back to its owner), puts them in the sequence's order, and attends each of its pieces
to the keys up to that piece's end, with a causal mask offset by the piece's start.
The model's attention modules take it as their `attention_fn` (the reference GPT calls torch's
`scaled_dot_product_attention` through it), and a Hugging Face model's through transformers' attention interface
(`HF_ATTENTION`), so an activation-checkpointed block's recompute attends the same way.
(torch's own `context_parallel` swaps SDPA on CUDA; its CPU SDPA has no sharding rule for it, and it fails on gloo.)
The model's positions (the GPT's position embedding, a Llama's rotary embedding) read the pieces' `position_ids`.
Hugging Face's labels (aligned with the inputs, shifted by the loss) are shifted before the cut (the backend).

The rest composes as a data axis does: the ranks of a group read the same samples, each counts the loss of its
own tokens (the step's totals are summed over every rank, as over data ranks), and the gradients are reduced over
data x context ranks (parallel/mesh.py folds `cp` into the data axis of the DeviceMesh).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from disttrain.errors import ConfigError
from disttrain.parallel.stages import POSITIONS


class ContextParallel:
    """This rank's pieces of every sequence (`shard`), the attention over the whole sequence (`attend`), and the
    outputs of the whole sequence (`whole`)."""

    def __init__(self, group, size: int, rank: int, meter: Any = None, shares: int = 1, compiled: bool = False):
        self.group, self.size, self.rank = group, size, rank
        self.gather = torch.compiler.disable(_Gather.apply) if compiled else _Gather.apply
        """The keys' and values' gather; under `parallel.compile` run between the compiled graphs (a graph break dynamo
        would otherwise make at the meter's clock, with a warning on every rank)."""
        self.shares = shares
        """What else splits a rank's share of a sequence (sequence parallelism's tensor degree): a batch is padded to
        2 x size pieces whose pairs divide by it."""
        self.meter = meter
        """The strategy's `CommMeter` (parallel/comm.py), which times the keys' and values' gathers and their
        gradients' reduce-scatters too (`comm_s`, `comm_bytes`); None: untimed."""
        self._biases: dict[tuple[int, int], Any] = {}

    def pieces(self, width: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The positions of a sequence of `width` tokens (a multiple of 2 x size) that this rank holds: pieces r and
        2 size - 1 - r of 2 size equal ones (built on `device`: no copy to it, which would wait for the stream)."""
        piece = width // (2 * self.size)
        return torch.cat([torch.arange(p * piece, (p + 1) * piece, device=device) for p in self.held()])

    def positions(self, width: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The positions of this rank's `width` tokens of a sequence (its two pieces, joined): a pipeline stage's
        (parallel/stages.py `POSITIONS`)."""
        return self.pieces(width * self.size, device)

    def held(self) -> tuple[int, int]:
        """The indices of this rank's two pieces among the sequence's 2 x size: r and 2 size - 1 - r."""
        return self.rank, 2 * self.size - 1 - self.rank

    def owners(self) -> list[tuple[int, int]]:
        """(rank, its first or second piece) of each of the sequence's 2 x size pieces, in the sequence's order."""
        return [(p, 0) if p < self.size else (2 * self.size - 1 - p, 1) for p in range(2 * self.size)]

    def in_order(self, parts: list[torch.Tensor], dim: int) -> torch.Tensor:
        """Every rank's two pieces (`parts`, in rank order, each its pieces joined along `dim`) in the sequence's
        order."""
        piece = parts[0].shape[dim] // 2
        return torch.cat([parts[rank].narrow(dim, second * piece, piece) for rank, second in self.owners()], dim=dim)

    def parallelize(self, model: nn.Module) -> None:
        """Give every attention of `model` this rank's: a Hugging Face model's through transformers' attention
        interface (`HF_ATTENTION`), another's attention modules through their `attention_fn` (the reference GPT);
        and a pipeline's stages their pieces' positions (`stages.POSITIONS`)."""
        setattr(model, POSITIONS, self.positions)
        if hasattr(model, "config") and hasattr(model.config, "_attn_implementation"):  # a transformers model
            try:
                from transformers import AttentionInterface, AttentionMaskInterface
            except ImportError as exc:
                import transformers

                raise ConfigError(f"parallel.context > 1 runs a Hugging Face model's attention through transformers' "
                                  f"AttentionInterface and AttentionMaskInterface, which transformers "
                                  f"{transformers.__version__} lacks; upgrade transformers (tested: 5.24)") from exc

            AttentionInterface.register(HF_ATTENTION, _hf_attention)
            AttentionMaskInterface.register(HF_ATTENTION, _no_mask)  # (the pieces' own causal masks are `attend`'s)
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

    def padded(self, width: int) -> int:
        """`width` tokens right-padded on to a multiple of the 2 x size pieces (each split in `shares`)."""
        pieces = 2 * self.size * (self.shares // math.gcd(self.shares, 2))  # (a rank's two pieces split in `shares`)
        return width + -width % pieces

    def check(self, batch: Any) -> None:
        """ConfigError (one line) for a batch that cannot be cut: not a dict with `input_ids`, or one whose attention
        mask or positions the pieces would ignore (`pipeline.check_mask`)."""
        if not isinstance(batch, dict) or not isinstance(batch.get("input_ids"), torch.Tensor):
            raise ConfigError("parallel.context > 1 cuts sequences by their 'input_ids': give dict batches with "
                              "'input_ids' (and 'labels')")
        from disttrain.parallel.pipeline import check_mask

        check_mask(batch, "parallel.context")  # (the whole sequence's: its pieces attend without a mask)

    def shard(self, batch: Any, width: int = 0, check: bool = True) -> Any:
        """This rank's two pieces of every sequence-valued tensor of a dict batch (dim 1, the sequence), with their
        `position_ids`; other values as they are. The sequences are first right-padded to `padded`, or to `width`
        tokens (one of `padded`'s) where that is longer: a pipeline's micro-batches cut at one width. `check=False`:
        `check` ran on the batch already (its mask read once)."""
        if check:
            self.check(batch)
        given, width = width, batch["input_ids"].shape[1]
        target = max(self.padded(width), given)
        batch, width = pad_sequences(batch, target), max(width, target)  # (padded to its longest: to equal pieces)
        mine = self.pieces(width, batch["input_ids"].device)
        out = {key: value.index_select(1, mine) if _is_sequence(value, width) else value
               for key, value in batch.items()}
        if "position_ids" not in out:
            out["position_ids"] = mine.expand(batch["input_ids"].shape[0], len(mine))
        return out

    def whole(self, outputs: Any, width: int) -> Any:
        """The logits of every rank's pieces, joined in the sequence's order of `width` tokens (what `shard` padded,
        cut off): a tensor, or the `logits` of a Hugging Face output (in place). For evaluation and `forward()`."""
        if isinstance(outputs, dict) and isinstance(outputs.get("logits"), torch.Tensor):
            outputs["logits"] = self.whole(outputs["logits"], width)
            return outputs
        if not isinstance(outputs, torch.Tensor):
            raise ConfigError(f"parallel.context > 1 joins the ranks' logits, and the model returned "
                              f"{type(outputs).__name__}; return logits (or an output with a `logits` field)")
        if outputs.dim() == 1 and not outputs.numel():  # a pipeline stage without the head (as its whole group)
            return outputs
        parts = [torch.empty_like(outputs) for _ in range(self.size)]
        dist.all_gather(parts, outputs.contiguous(), group=self.group)
        return self.in_order(parts, 1)[:, :width]

    def attend(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        """Causal attention of this rank's two pieces of queries, each over the keys and values of the sequence up
        to the piece's end (gathered from the group, in the sequence's order), with torch's lower-right causal bias
        (no mask tensor: SDPA's fused kernels run)."""
        if attn_mask is not None or not is_causal:
            raise ConfigError("parallel.context > 1 runs causal attention without a mask only (no padding mask, "
                              "no bidirectional attention)")
        piece = q.shape[-2] // 2
        metered = torch.is_grad_enabled()  # (evaluation's and forward()'s gathers are not a step's: not metered)
        keys, values = self.gather(k, self, metered), self.gather(v, self, metered)
        out = []
        for half, p in enumerate(self.held()):
            seen = (p + 1) * piece
            out.append(F.scaled_dot_product_attention(
                q.narrow(-2, half * piece, piece), keys.narrow(-2, 0, seen), values.narrow(-2, 0, seen),
                attn_mask=self._bias(piece, seen), dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa))
        return torch.cat(out, dim=-2)

    def _bias(self, queries: int, keys: int):
        """torch's lower-right causal bias, built once per shape: a tensor subclass without storage, which cannot
        be built while a TorchDispatchMode runs (FlopCounterMode, bench/tensor_calls.recording)."""
        from torch.nn.attention.bias import causal_lower_right

        if (queries, keys) not in self._biases:
            self._biases[queries, keys] = causal_lower_right(queries, keys)
        return self._biases[queries, keys]


HF_ATTENTION = "disttrain_context"
"""The name a Hugging Face model's attention runs under (transformers' AttentionInterface)."""


def _hf_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                  **kwargs):
    """transformers' attention-function signature: (batch, heads, tokens, dim) in, (batch, tokens, heads, dim) out.
    Attention variants it cannot run (a sliding window, logit soft-capping, attention sinks) are refused."""
    unsupported = [name for name in ("sliding_window", "softcap", "s_aux") if kwargs.get(name) is not None]
    if unsupported or getattr(module, "is_causal", True) is False:
        raise ConfigError(f"parallel.context > 1 runs plain causal attention, and this model's attention uses "
                          f"{', '.join(unsupported) or 'bidirectional attention'}; set parallel.context = 1")
    out = module._disttrain_context.attend(query, key, value, is_causal=True, dropout_p=dropout, scale=scaling,
                                           enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs) -> None:
    return None


class _Gather(torch.autograd.Function):
    """The ranks' pieces of the group, joined along the sequence (dim -2) in the sequence's order; backward: the sum
    of every rank's gradient for this rank's pieces, by one reduce-scatter (half an all-reduce's traffic), its input
    each rank's pieces in rank order.
    (torch.distributed.nn.functional.all_gather's backward on gloo scatters from group ranks as if they were global
    ones, which fails on any group but the first.)"""

    @staticmethod
    def forward(ctx, mine: torch.Tensor, split: ContextParallel, metered: bool) -> torch.Tensor:
        ctx.split, ctx.width = split, mine.shape[-2]
        parts = [torch.empty_like(mine, memory_format=torch.contiguous_format) for _ in range(split.size)]
        _metered(split.meter if metered else None, functools.partial(dist.all_gather, parts, mine.contiguous(),
                                                                        group=split.group),
                 mine.numel() * mine.element_size() * split.size)
        return split.in_order(parts, -2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # the sequence first, each rank's two pieces put next to each other (rank order: the reduce-scatter's
        # blocks), summed in float32 (16-bit gradients of several ranks): one copy
        whole, piece = grad.movedim(-2, 0), ctx.width // 2
        total = torch.empty(whole.shape, dtype=torch.float32, device=grad.device)
        for p, (rank, second) in enumerate(ctx.split.owners()):
            start = (2 * rank + second) * piece
            total[start:start + piece].copy_(whole[p * piece:(p + 1) * piece])
        mine = total.new_zeros((ctx.width, *total.shape[1:]))  # (zeros: a fake group's reduce-scatter writes none)
        _metered(ctx.split.meter, functools.partial(dist.reduce_scatter_single, mine, total, group=ctx.split.group),
                 total.numel() * total.element_size())
        return mine.movedim(0, -2).to(grad.dtype), None, None


def _metered(meter: Any, call, nbytes: int) -> None:
    """`call()`, a collective of `nbytes` (nccl-tests' size), timed by `meter` where there is one."""
    if meter is None:
        call()
        return
    from disttrain.parallel.comm import timed_call

    timed_call(meter, call, nbytes)


def pad_to_shares(batch: Any, shares: int) -> Any:
    """Sequence parallelism's batch, cut later into `shares` equal pieces of its width: a dict batch with `input_ids`
    right-padded to a multiple of `shares` (`pad_sequences`); a tuple, a tensor or a dict with `inputs` as it is where
    the model's input's width divides, else ConfigError (one line): disttrain cannot tell which of their positions a
    loss reads. (A dict of other keys, called by the names its model's forward takes, is passed as it is.)"""
    if isinstance(batch, dict) and "input_ids" in batch:
        width = batch["input_ids"].shape[1]
        return pad_sequences(batch, width + -width % shares)
    inputs = batch
    if isinstance(batch, (dict, tuple, list)):  # (what the model is called with: batches.ModelCall)
        inputs = batch.get("inputs") if isinstance(batch, dict) else next(iter(batch), None)
    if isinstance(inputs, torch.Tensor) and inputs.dim() >= 2 and inputs.shape[1] % shares:
        raise ConfigError(f"parallel.sequence_parallel: a batch of {inputs.shape[1]} tokens cannot be cut into "
                          f"parallel.tensor = {shares} equal shares; give dict batches with input_ids (and labels), "
                          f"which are padded to fit, or sequences of a multiple of {shares} tokens")
    return batch


def pad_sequences(batch: dict, width: int) -> dict:
    """A dict batch whose sequence-valued tensors are right-padded to `width` tokens (`_pad`); as it is where they
    are that wide already."""
    now = batch["input_ids"].shape[1]
    return {key: _pad(value, now, width - now, key) for key, value in batch.items()} if width > now else batch


def _pad(value: Any, width: int, extra: int, key: str) -> Any:
    """A sequence-valued tensor right-padded by `extra` positions (labels with the ignored index, positions going
    on, the rest with 0: padding on the right changes nothing before it under causal attention)."""
    if not _is_sequence(value, width):
        return value
    if key == "position_ids":
        more = value[:, -1:] + torch.arange(1, extra + 1, device=value.device)
        return torch.cat([value, more.to(value.dtype)], dim=1)
    fill = -100 if key == "labels" else 0  # (data.IGNORE_INDEX, cross-entropy's ignored label)
    return torch.cat([value, torch.full((value.shape[0], extra, *value.shape[2:]), fill, dtype=value.dtype,
                                        device=value.device)], dim=1)


def _is_sequence(value: Any, width: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == width
