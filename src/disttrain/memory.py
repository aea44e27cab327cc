"""Per-rank memory: an estimate from the config (no GPU, no real model needed) and a measurement on a real
run, so the estimate is checked rather than trusted.

Estimate (bytes per rank, steady state):
    parameters, gradients   full under single/ddp/zero1; FSDP2 shards of ceil(dim0 / shard group) rows
                            under zero2/fsdp/zero3/hsdp (what FSDP2 allocates, padding included)
    optimizer state         AdamW: two moments per element + one float32 step per tensor; SGD: one
                            momentum buffer; zero1: this rank's share, partitioned the way
                            ZeroRedundancyOptimizer does (largest tensors first, to the least-loaded rank)
    activations             what autograd saves for backward for one micro-batch of the reference GPT, or of a
                            Llama-family HF model in fp32, counted op by op for the implementation (exact in
                            fp32 on CPU; with activation checkpointing only each block's input is kept);
                            `None` for other models

Measurement: tensor bytes of local parameters, gradients and optimizer state, and the unique storages that
autograd saves during a forward (saved-tensor hooks), parameters excluded. DeepSpeed keeps gradients and master
copies in buffers of its own: those are found by walking the engine's objects (see `measure`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
from torch import nn

from disttrain.config import Config, ModelConfig
from disttrain.parallel import registry


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


def gpt_activation_bytes(m: ModelConfig, micro_batch: int, checkpointing: bool, precision: str = "fp32",
                         linears: str = "autocast") -> int:
    """Bytes autograd keeps for backward after the forward of one micro-batch of the reference GPT.

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
    """
    b, t, d, h, v, n = micro_batch, m.seq_len, m.d_model, m.n_head, m.vocab_size, m.n_layer
    mixed = precision in ("bf16-mixed", "fp16-mixed")
    act = 4 if precision == "fp32" else 2  # activations
    res = 2 if precision == "bf16-true" or (mixed and linears == "gathered16") else 4  # residual stream, LN
    ln_out = res if mixed and linears == "zero3" else act  # LayerNorm outputs, as the next linear saves them
    copies = 2 if mixed and linears == "autocast" else 0  # bytes per weight element autocast saves
    # autocast casts ln1's output once for each of q, k and v, and each keeps its own copy: 2 more than one linear
    recasts = 2 * act * d if mixed and linears == "autocast" else 0
    block = res * d if checkpointing else 2 * res * d + 4 * res + 2 * ln_out * d + 12 * act * d + 4 * h + recasts
    outside = res * d + 2 * res + ln_out * d + 4 * v + 8 * 2
    weights = ((0 if checkpointing else n * 12 * d * d) + v * d) * copies
    return b * t * (n * block + outside) + weights + 8 * t + 4 + (4 if precision == "fp16-mixed" else 0)


LLAMA_FAMILY = ("llama", "mistral", "qwen2")
"""Hugging Face `model_type`s with Llama's layer (RMSNorm, rotary attention with grouped KV heads, SwiGLU MLP)."""


def llama_activation_bytes(hf: dict, micro_batch: int, seq_len: int, checkpointing: bool) -> int:
    """Bytes autograd keeps for backward after the forward of one micro-batch of a Llama-family HF model (fp32, SDPA
    attention on CPU or a fused kernel, unpadded batch), counted op by op for transformers' implementation.

    Per layer and token: each RMSNorm keeps its input, the normalised tensor, its output (3 d) and the rstd (1);
    attention keeps q after rotary (d), k and v (2 x kv_heads x head_dim), SDPA's logsumexp (heads) and the output
    projection's input (d); the MLP keeps gate, SiLU(gate), up and the down projection's input (4 x intermediate).
    Outside: token ids, the rotary cos/sin (t x head_dim each, shared by the layers), the final norm and the
    float32 log-softmax over the vocabulary of the t - 1 shifted positions with their int64 targets. With
    checkpointing a layer keeps only its input (and cos/sin are recomputed)."""
    b, t, d, n = micro_batch, seq_len, hf["hidden_size"], hf["num_hidden_layers"]
    heads = hf["num_attention_heads"]
    kv, head_dim = hf.get("num_key_value_heads") or heads, hf.get("head_dim") or d // heads
    inter, vocab = hf["intermediate_size"], hf["vocab_size"]
    if checkpointing:
        layer, rotary = 4 * d, 0
    else:
        layer = 4 * (3 * d + 1) * 2 + 4 * (d + 2 * kv * head_dim + d) + 4 * heads + 4 * 4 * inter
        rotary = 2 * 4 * t * head_dim
    outside = 8 * b * t + rotary + b * t * 4 * (3 * d + 1) + b * (t - 1) * (4 * vocab + 8) + 4
    return b * t * n * layer + outside


def _activations(cfg: Config, layout) -> tuple[int | None, int | None, list[str]]:
    """(activations, with checkpointing, notes) for the models the estimator knows: the reference GPT, and
    Llama-family HF models in fp32."""
    precision, micro = cfg.parallel.precision, cfg.data.micro_batch_size
    if cfg.model.name == "gpt":
        acts, acts_ac = (gpt_activation_bytes(cfg.model, micro, ac, precision, layout.linears) for ac in (False, True))
        notes = []
        if precision in ("bf16-mixed", "fp16-mixed") and layout.linears == "autocast":
            notes.append("activations include the 16-bit weight copies autocast saves for backward")
        return acts, acts_ac, notes
    if cfg.model.name.startswith("hf:"):
        from disttrain.models.hf import hf_directory

        hf = json.loads((hf_directory(cfg.model.name) / "config.json").read_text())
        if hf.get("model_type") in LLAMA_FAMILY and precision == "fp32":
            acts, acts_ac = (llama_activation_bytes(hf, micro, cfg.model.seq_len, ac) for ac in (False, True))
            return acts, acts_ac, []
        return None, None, [f"activations are estimated for Llama-family HF models ({', '.join(LLAMA_FAMILY)}) in "
                            "fp32 only; measure your model instead (`disttrain bench memory`)"]
    return None, None, ["activations are estimated for the reference GPT and Llama-family HF models only; "
                        "measure your model instead"]


def estimate(cfg: Config, world: int, strategy: str | None = None, rank: int | None = None) -> MemoryEstimate:
    """Bytes per rank, from the strategy's memory layout (its spec); where ranks differ (zero1, deepspeed),
    `rank`'s or, with None, the most loaded one's."""
    spec = registry.resolve(strategy or cfg.parallel.strategy, world)
    layout = spec.memory([tuple(s) for s in param_shapes(cfg.model)], cfg, world, rank)
    acts, acts_ac, notes = _activations(cfg, layout)
    notes = list(layout.notes) + notes
    return MemoryEstimate(spec.name, world, layout.params, layout.grads, layout.optimizer, acts, acts_ac, notes)


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


def _reachable_storages(roots: list) -> dict[int, int]:
    """Storage address -> bytes of every tensor reachable from `roots` through attributes, lists, tuples, dicts
    and tensors' gradients (submodules are not entered: their parameters and buffers are counted apart)."""
    found, seen, todo, entered = {}, set(), list(roots), {id(r) for r in roots}
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = _local(obj).untyped_storage()
            if obj.device.type != "meta" and storage.nbytes():
                found[storage.data_ptr()] = storage.nbytes()
            if obj.grad is not None:  # e.g. a master copy's gradient
                todo.append(obj.grad)
        elif isinstance(obj, (list, tuple, set)):
            todo.extend(obj)
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif (id(obj) in entered or not isinstance(obj, nn.Module)) and hasattr(obj, "__dict__") \
                and not isinstance(obj, type) and type(obj).__module__.split(".")[0] not in ("builtins", "torch"):
            todo.extend(vars(obj).values())
    return found


def measure(build, batch) -> dict[str, int]:
    """Build a backend with `build()`, run one step of `batch` and return the bytes this rank holds: params,
    grads (after backward), optimizer state (after the step: its state, plus any tensor it steps that is not
    a model parameter, i.e. a master copy) and activations saved for backward (during forward).

    An engine strategy (deepspeed) keeps gradients in buffers of its own rather than in `param.grad`: there,
    grads are every tensor storage reachable from the engine (or a parameter's `.grad`) after backward that is
    neither a parameter, a buffer nor a master copy."""
    backend = build()
    params = list(backend.model.parameters())
    owned = params + [p.ds_tensor for p in params if hasattr(p, "ds_tensor")]  # ZeRO-3's partitions
    param_ptrs = {_local(p).untyped_storage().data_ptr() for p in owned}
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
    engine = getattr(backend.prepared, "engine", None)
    if engine is None:
        grads = _tensor_bytes(p.grad for p in params if p.grad is not None)
    else:  # classified after the step, once the master copies are known
        held = _reachable_storages([engine, *(p.grad for p in params)])
    backend.optim_step()
    optimizer = getattr(backend.optimizer, "optim", backend.optimizer)  # ZeroRedundancyOptimizer: this rank's
    # what it stepped: its groups' tensors and its state's keys (DeepSpeed ZeRO-3 fills the groups only during
    # the step); those that are not parameters are master copies
    stepped = [t for t in [*(t for group in optimizer.param_groups for t in group["params"]), *optimizer.state]
               if _local(t).untyped_storage().data_ptr() not in param_ptrs]
    if engine is not None:
        skip = param_ptrs | {_local(t).untyped_storage().data_ptr() for t in [*stepped, *backend.model.buffers()]}
        grads = sum(n for ptr, n in held.items() if ptr not in skip)
    state = [v for per_param in optimizer.state.values() for v in per_param.values() if torch.is_tensor(v)]
    return {"params": _tensor_bytes(owned), "grads": grads, "optimizer": _tensor_bytes(state + stepped),
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
