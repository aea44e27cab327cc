"""Per-rank memory: an estimate from the config (no GPU, no real model needed) and a measurement on a real
run, so the estimate is checked rather than trusted.

Estimate (bytes per rank, steady state):
    parameters, gradients   full under single/ddp/zero1; FSDP2 shards of ceil(dim0 / shard group) rows
                            under zero2/fsdp/zero3/hsdp (what FSDP2 allocates, padding included)
    optimizer state         AdamW: two moments per element + one float32 step per tensor; SGD: one
                            momentum buffer; zero1: this rank's share, partitioned the way
                            ZeroRedundancyOptimizer does (largest tensors first, to the least-loaded rank)
    activations             what autograd saves for backward for one micro-batch of the reference GPT,
                            counted op by op for this implementation (exact in fp32 on CPU; with activation
                            checkpointing only each block's input is kept); `None` for other models

Measurement: tensor bytes of local parameters, gradients and optimizer state, and the unique storages that
autograd saves during a forward (saved-tensor hooks), parameters excluded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from disttrain.config import Config, ModelConfig, resolve_strategy

SHARDED = ("zero2", "fsdp", "zero3", "hsdp")
ALL_STRATEGIES = ("single", "ddp", "zero1", "zero2", "fsdp", "hsdp")


@dataclass
class MemoryEstimate:
    strategy: str
    world_size: int
    params: int
    grads: int
    optimizer: int
    activations: int | None  # without activation checkpointing
    activations_ac: int | None  # with activation checkpointing
    notes: list[str] = field(default_factory=list)

    def total(self, activation_checkpointing: bool) -> int | None:
        acts = self.activations_ac if activation_checkpointing else self.activations
        return None if acts is None else self.params + self.grads + self.optimizer + acts


def param_shapes(model_cfg: ModelConfig) -> list[torch.Size]:
    """Shapes of the model's trainable parameters (tied ones once), built on the meta device: no memory."""
    from disttrain.models import build_model

    with torch.device("meta"):
        model = build_model(model_cfg)
    return [p.shape for p in model.parameters() if p.requires_grad]


def _dtype_bytes(precision: str) -> int:
    return 2 if precision == "bf16-true" else 4


def _sharded_numel(shape: torch.Size, shards: int) -> int:
    if len(shape) == 0:
        return 1
    return math.ceil(shape[0] / shards) * math.prod(shape[1:])


def zero1_partition(shapes: list[torch.Size], world: int) -> list[list[int]]:
    """Parameter indices per rank, as ZeroRedundancyOptimizer assigns them (the default param groups)."""
    groups = [[i for i, s in enumerate(shapes) if len(s) >= 2], [i for i, s in enumerate(shapes) if len(s) < 2]]
    sizes, parts = [0] * world, [[] for _ in range(world)]
    for group in groups:
        for i in sorted(group, key=lambda i: math.prod(shapes[i]), reverse=True):
            rank = sizes.index(min(sizes))
            parts[rank].append(i)
            sizes[rank] += math.prod(shapes[i])
    return parts


def _deepspeed_bytes(numels: list[int], elem: int, world: int, cfg: Config) -> tuple[int, int, int]:
    """(params, grads, optimizer) per rank for DeepSpeed ZeRO with the user's torch optimizer: stage 0
    replicates everything; stages 1-2 keep full parameters, reduce gradients into this rank's partition,
    and add an fp32 master copy of the partition next to the optimizer state over it; stage 3 also
    partitions the parameters."""
    numel = sum(numels)
    stage, part = cfg.parallel.deepspeed_stage, math.ceil(numel / world)
    if stage == 0:
        return numel * elem, numel * elem, _optimizer_bytes(numels, elem, cfg.optim.name)
    state = _optimizer_bytes([part], elem, cfg.optim.name) + part * 4  # over the flat partition + master copy
    return (part if stage == 3 else numel) * elem, part * elem, state


def _optimizer_bytes(numels: list[int], elem: int, optim: str) -> int:
    if optim == "sgd":
        return sum(numels) * elem
    return sum(numels) * 2 * elem + 4 * len(numels)  # exp_avg, exp_avg_sq, and a float32 step per tensor


def gpt_activation_bytes(m: ModelConfig, micro_batch: int, checkpointing: bool) -> int:
    """Bytes autograd keeps for backward after the forward of one micro-batch of the reference GPT (fp32).

    Per block: LayerNorm inputs and outputs (2 x 2 x BTd), the qkv output (3 BTd; q, k, v are views of it),
    the attention output (BTd; the projection's input is a view of it), the MLP hidden before and after
    GELU (2 x 4 BTd) -- 16 BTd floats -- plus LayerNorm mean/rstd (4 BT) and the attention logsumexp (BhT).
    Outside the blocks: ln_f input/output and statistics, the log-softmax of the logits (BTV), the token
    ids and targets (int64). With checkpointing, a block keeps only its input (BTd).
    """
    b, t, d, h, v, n = micro_batch, m.seq_len, m.d_model, m.n_head, m.vocab_size, m.n_layer
    block = 4 * d if checkpointing else 4 * (16 * d + 4 + h)
    outside = 4 * (2 * d + 2 + v) + 8 * 2  # ln_f in/out + mean/rstd, log-softmax, then targets + ids (int64)
    return b * t * (n * block + outside) + 8 * t + 4  # + positions (int64) and the loss's total weight


def estimate(cfg: Config, world: int, strategy: str | None = None) -> MemoryEstimate:
    strategy = strategy or resolve_strategy(cfg, world)
    shapes = param_shapes(cfg.model)
    elem = _dtype_bytes(cfg.parallel.precision)
    full = [math.prod(s) for s in shapes]
    notes = []
    if strategy == "deepspeed":
        params, grads, optimizer = _deepspeed_bytes(full, elem, world, cfg)
        notes.append(f"deepspeed: ZeRO stage {cfg.parallel.deepspeed_stage}'s layout (its fp32 master partition "
                     "counted with the optimizer); a model, not validated by measurement: DeepSpeed's buckets, "
                     "padding and ZeRO-3 persistent small parameters come on top")
    elif strategy in SHARDED:
        shards = (cfg.parallel.hsdp_shard_size or world) if strategy == "hsdp" else world
        local = [_sharded_numel(s, shards) for s in shapes]
        params = grads = sum(local) * elem
        optimizer = _optimizer_bytes(local, elem, cfg.optim.name)
        if strategy == "zero2":
            notes.append("zero2 also holds each block's full parameters from its forward to its backward")
    else:
        params = grads = sum(full) * elem
        if strategy == "ddp" and not cfg.parallel.gradient_as_bucket_view:
            grads *= 2  # gradients plus DDP's communication buckets
        if strategy == "zero1":
            mine = zero1_partition(shapes, world)
            optimizer = max(_optimizer_bytes([full[i] for i in part], elem, cfg.optim.name) for part in mine)
            notes.append("zero1: optimizer state of the most loaded rank")
        else:
            optimizer = _optimizer_bytes(full, elem, cfg.optim.name)
    acts = acts_ac = None
    if cfg.model.name == "gpt":
        acts = gpt_activation_bytes(cfg.model, cfg.data.micro_batch_size, checkpointing=False)
        acts_ac = gpt_activation_bytes(cfg.model, cfg.data.micro_batch_size, checkpointing=True)
        if cfg.parallel.precision != "fp32":
            notes.append("activations are counted for fp32; mixed precision keeps several of them in 16 bits")
    else:
        notes.append("activations are estimated for the reference GPT only; measure your model instead")
    return MemoryEstimate(strategy, world, params, grads, optimizer, acts, acts_ac, notes)


# ----------------------------------------------------------------------------------------------
# Measurement on a real backend


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        t = _local(t)
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if t.numel() and key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def measure(backend, batch) -> dict[str, int]:
    """Run one step of `batch` on `backend` and return the bytes this rank holds: params, grads (after
    backward), optimizer state (after the step) and activations saved for backward (during forward)."""
    params = [p for p in backend.model.parameters()]
    param_ptrs = {_local(p).untyped_storage().data_ptr() for p in params}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        # parameters are not activations: the parameter itself, a view of it (FSDP2 saves transposed views
        # of its gathered parameters), or a sharded DTensor
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter) or hasattr(t, "to_local"):
            return t
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_ptrs and storage.nbytes():
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        backend.forward_backward(batch)
    grads = _tensor_bytes(p.grad for p in params if p.grad is not None)
    backend.optim_step()
    optimizer = _tensor_bytes(v for state in backend.optimizer.state.values() for v in state.values()
                              if torch.is_tensor(v))
    if hasattr(backend.optimizer, "optim"):  # ZeroRedundancyOptimizer keeps this rank's state in .optim
        optimizer = _tensor_bytes(v for state in backend.optimizer.optim.state.values() for v in state.values()
                                  if torch.is_tensor(v))
    return {"params": _tensor_bytes(params), "grads": grads, "optimizer": optimizer,
            "activations": sum(saved.values())}


# ----------------------------------------------------------------------------------------------
# `disttrain estimate-memory`


def report(cfg: Config, world: int, strategies: list[str], budget_gib: float | None) -> str:
    """A table of per-rank bytes for each strategy, with and without activation checkpointing."""
    mib = 2**20
    rows = [f"per-rank memory estimate: world size {world}, micro-batch {cfg.data.micro_batch_size}, "
            f"seq_len {cfg.model.seq_len}, precision {cfg.parallel.precision}, optimizer {cfg.optim.name}", "",
            f"{'strategy':<9} {'params':>9} {'grads':>9} {'optim':>9} {'activ.':>9} {'activ.AC':>9} "
            f"{'total':>9} {'total AC':>9}  (MiB)" + ("  fits" if budget_gib else "")]
    notes = []
    for strategy in strategies:
        e = estimate(cfg, world, strategy)
        cells = [e.params, e.grads, e.optimizer, e.activations, e.activations_ac, e.total(False), e.total(True)]
        text = " ".join(f"{c / mib:>9.1f}" if c is not None else f"{'n/a':>9}" for c in cells)
        fits = ""
        if budget_gib:
            budget = budget_gib * 2**30
            fits = "  " + ("yes" if (e.total(False) or 0) <= budget else
                           "with AC" if (e.total(True) or 0) <= budget else "no")
        rows.append(f"{strategy:<9} {text}{fits}")
        notes += [n for n in e.notes if n not in notes]
    rows += ["", *(f"note: {n}" for n in notes),
             "Steady-state bytes per rank; allocator caches, communication buffers and temporaries come on top."]
    return "\n".join(rows)
