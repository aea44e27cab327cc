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

import dataclasses
import json
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

from disttrain.config import Config, ModelConfig
from disttrain.parallel import pipeline, placement, registry, tensor
from disttrain.parallel.activation_checkpoint import transformer_blocks
from disttrain.parallel.layout import replicated
from disttrain.parallel.mesh import MeshLayout, layout_for
from disttrain.parallel.state import local_tensor


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
    layout: str = ""
    """How the job lies on the ranks (`MeshLayout.describe`, e.g. "pp2 x dp_shard2"); empty when the model is
    not split (pipeline = tensor = 1)."""
    rank: int | None = None
    """The rank estimated (the most loaded one unless one was asked for); None where all ranks hold the same."""

    def total(self, activation_checkpointing: bool) -> int | None:
        acts = self.activations_ac if activation_checkpointing else self.activations
        return None if acts is None else self.params + self.grads + self.optimizer + acts


def meta_model(model_cfg: ModelConfig) -> nn.Module:
    """The model built on the meta device: names and shapes, no memory."""
    from disttrain.models import build_model

    with torch.device("meta"):
        return build_model(model_cfg)


def param_shapes(model_cfg: ModelConfig, trainable: bool = True) -> list[torch.Size]:
    """Shapes of the model's trainable (or frozen: model.freeze) parameters (tied ones once), built on the meta
    device: no memory."""
    return [p.shape for p in meta_model(model_cfg).parameters() if p.requires_grad == trainable]


class Frozen(NamedTuple):
    """What model.freeze spares the activations (`frozen_parts`)."""
    blocks: int = 0
    """Leading transformer blocks that keep nothing."""
    embeds: bool = True
    """The embeddings train (and keep the token ids)."""
    head: bool = True
    """The output projection trains (and keeps its input)."""


def gpt_activation_bytes(m: ModelConfig, micro_batch: int, checkpointing: bool, precision: str = "fp32",
                         linears: str = "autocast", *, tensor: int = 1, sequence_parallel: bool = False,
                         split_logits: bool = False,
                         blocks: int | None = None, embeds: bool = True, head: bool = True, ids: bool = True,
                         head_trains: bool = True) -> int:
    """Bytes autograd keeps for backward after the forward of one micro-batch of the reference GPT (or of a
    pipeline stage of it: `blocks` blocks, with the embedding if `embeds` and ln_f, the head and the loss if
    `head`; `ids`: with the token ids the embedding saves, which a pipeline keeps for the whole step apart;
    `head_trains`: a frozen head's weight (model.freeze) needs no gradient, so the head keeps no input).

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
    n = m.n_layer if blocks is None else blocks
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
        total += b * t * (ln_out * d * head_trains + 4 * v // (tp if split_logits else 1) + 8)
        total += 4 if precision == "fp16-mixed" else 0
    weights = ((0 if checkpointing else n * 12 * d * d) + (v * d if head else 0)) * copies // tp
    return total + weights


LLAMA_FAMILY = ("llama", "mistral", "qwen2")
"""Hugging Face `model_type`s with Llama's layer (RMSNorm, rotary attention with grouped KV heads, SwiGLU MLP)."""


def llama_activation_bytes(hf: dict, micro_batch: int, seq_len: int, checkpointing: bool,
                           frozen: Frozen | None = None) -> int:
    """Bytes autograd keeps for backward after the forward of one micro-batch of a Llama-family HF model (fp32, SDPA
    attention on CPU or a fused kernel, unpadded batch), counted op by op for transformers' implementation.

    Per layer and token: each RMSNorm keeps its input, the normalised tensor, its output (3 d) and the rstd (1);
    attention keeps q after rotary (d), k and v (2 x kv_heads x head_dim), SDPA's logsumexp (heads) and the output
    projection's input (d); the MLP keeps gate, SiLU(gate), up and the down projection's input (4 x intermediate).
    Outside: token ids, the rotary cos/sin (t x head_dim each, shared by the layers), the final norm and the
    float32 log-softmax over the vocabulary of the t - 1 shifted positions with their int64 targets. With
    checkpointing a layer keeps only its input (and cos/sin are recomputed). `frozen`: what model.freeze spares."""
    frozen = frozen or Frozen()
    b, t, d, n = micro_batch, seq_len, hf["hidden_size"], hf["num_hidden_layers"] - frozen.blocks
    heads = hf["num_attention_heads"]
    kv, head_dim = hf.get("num_key_value_heads") or heads, hf.get("head_dim") or d // heads
    inter, vocab = hf["intermediate_size"], hf["vocab_size"]
    if checkpointing:
        layer, rotary = 4 * d, 0
    else:
        layer = 4 * (3 * d + 1) * 2 + 4 * (d + 2 * kv * head_dim + d) + 4 * heads + 4 * 4 * inter
        rotary = 2 * 4 * t * head_dim
    norm = 4 * (2 * d + 1 + d * frozen.head)  # (a frozen lm_head keeps no input)
    outside = 8 * b * t * frozen.embeds + rotary + b * t * norm + b * (t - 1) * (4 * vocab + 8) + 4
    # the first trained layer's input needs no gradient (frozen embeddings and layers before it): its first RMSNorm
    # keeps neither that input (pow's) nor the rstd (the product's), only the normalised tensor (measured)
    spared = 4 * (d + 1) if not frozen.embeds and n and not checkpointing else 0
    return b * t * (n * layer - spared) + outside


def frozen_parts(model: nn.Module) -> Frozen:
    """Autograd saves nothing for frozen embeddings and the frozen blocks before the first trained parameter, since
    nothing before them needs a gradient, and a frozen head keeps no input (measured). A frozen block after a
    trained one still passes gradients back: counted in full, an upper bound."""
    family = pipeline.FAMILIES[pipeline.family_of(model)]

    def trains(*names: str) -> bool:
        return any(p.requires_grad for name in names for p in model.get_submodule(name).parameters())

    head = trains(family.head[-1])
    if trains(*family.embeddings):
        return Frozen(0, True, head)
    blocks = transformer_blocks(model)
    skip = next((i for i, block in enumerate(blocks) if any(p.requires_grad for p in block.parameters())), len(blocks))
    return Frozen(skip, False, head)


def _activations(cfg: Config, layout, mesh: MeshLayout | None = None, model: nn.Module | None = None,
                 stage_rank: int = 0) -> tuple[int | None, int | None, list[str]]:
    """(activations, with checkpointing, notes) for the models the estimator knows: the reference GPT (on any
    layout), and Llama-family HF models in fp32 (model not split)."""
    precision, micro = cfg.parallel.precision, cfg.data.micro_batch_size
    if mesh is not None and cfg.model.name == "gpt":
        return _gpt_split_activations(cfg, layout.linears, mesh, model, stage_rank)
    if mesh is not None:
        return None, None, ["activations under parallel.pipeline / parallel.tensor are estimated for the reference "
                            "GPT only; measure your model instead (`disttrain bench memory`)"]
    if cfg.model.name == "gpt":
        frozen = frozen_parts(meta_model(cfg.model)) if cfg.model.freeze else Frozen()
        acts, acts_ac = (gpt_activation_bytes(cfg.model, micro, ac, precision, layout.linears,
                                              blocks=cfg.model.n_layer - frozen.blocks, embeds=frozen.embeds,
                                              head_trains=frozen.head) for ac in (False, True))
        notes = []
        if precision in ("bf16-mixed", "fp16-mixed") and layout.linears == "autocast":
            notes.append("activations include the 16-bit weight copies autocast saves for backward")
        return acts, acts_ac, notes
    if cfg.model.name.startswith("hf:"):
        from disttrain.models.hf import hf_directory

        hf = json.loads((hf_directory(cfg.model.name) / "config.json").read_text())
        if hf.get("model_type") in LLAMA_FAMILY and precision == "fp32":
            frozen = frozen_parts(meta_model(cfg.model)) if cfg.model.freeze else Frozen()
            acts, acts_ac = (llama_activation_bytes(hf, micro, cfg.model.seq_len, ac, frozen) for ac in (False, True))
            return acts, acts_ac, []
        return None, None, [f"activations are estimated for Llama-family HF models ({', '.join(LLAMA_FAMILY)}) in "
                            "fp32 only; measure your model instead (`disttrain bench memory`)"]
    return None, None, ["activations are estimated for the reference GPT and Llama-family HF models only; "
                        "measure your model instead"]


def estimate(cfg: Config, world: int, strategy: str | None = None, rank: int | None = None) -> MemoryEstimate:
    """Bytes per rank, from the strategy's memory layout (its spec) on the layout the config asks for
    (parallel.pipeline, parallel.tensor); where ranks differ (pipeline stages, zero1, deepspeed), `rank`'s or,
    with None, the most loaded one's."""
    spec = registry.resolve(strategy or cfg.parallel.strategy, world)
    mesh = layout_for(cfg.parallel, world, spec)
    if mesh.model_parallel:
        result = _split_estimate(cfg, spec, mesh, rank)
    else:
        layout = spec.memory([tuple(s) for s in param_shapes(cfg.model)], cfg, world, rank)
        if cfg.model.freeze:  # frozen parameters (model.freeze) are held as the others are, with no gradient or state
            layout.params += spec.memory([tuple(s) for s in param_shapes(cfg.model, False)], cfg, world, rank).params
        acts, acts_ac, notes = _activations(cfg, layout)
        result = MemoryEstimate(spec.name, world, layout.params, layout.grads, layout.optimizer, acts, acts_ac,
                                list(layout.notes) + notes)
    if cfg.model.freeze and result.activations is not None:
        result.notes.append("model.freeze: the frozen embeddings and blocks before the first trained one keep no "
                            "activations; the others are counted in full, an upper bound")
    return result


def _split_estimate(cfg: Config, spec, mesh: MeshLayout, rank: int | None) -> MemoryEstimate:
    """A model split by a pipeline and/or tensor parallelism: each rank's stage(s) and tensor shards (by parameter
    name, parallel/placement.py), the strategy's data axis on top, and the activations its schedule keeps."""
    model = meta_model(cfg.model)
    # ranks differ only by pipeline stage (tensor shards are alike; the composing strategies treat data ranks alike)
    ranks = [rank] if rank is not None else [mesh.world // mesh.pipeline * stage for stage in range(mesh.pipeline)]
    best = None
    for r in ranks:
        e = _rank_estimate(cfg, spec, mesh, model, r)
        if best is None or (e.total(False) or e.params + e.grads + e.optimizer) > \
                (best.total(False) or best.params + best.grads + best.optimizer):
            best = e
    if rank is None and mesh.pipeline > 1:
        best.notes.insert(0, f"pipeline: the most loaded stage's rank ({best.rank}) of {mesh.pipeline}")
    return best


def _rank_estimate(cfg: Config, spec, mesh: MeshLayout, model: nn.Module, rank: int) -> MemoryEstimate:
    stage_rank = mesh.coords(rank)["pp"]
    shapes = placement.local_shapes(model, mesh, cfg.parallel, stage_rank)
    reduced = mesh.data * mesh.context  # (context ranks reduce and shard as data ranks do: parallel/mesh.py)
    frozen = placement.local_shapes(model, mesh, cfg.parallel, stage_rank, trainable=False)
    if reduced > 1:
        index = mesh.data_rank(rank) * mesh.context + mesh.coords(rank)["cp"]
        layout = spec.memory(shapes, cfg, reduced, index, mesh=mesh)
        layout.params += spec.memory(frozen, cfg, reduced, index, mesh=mesh).params if frozen else 0
    else:  # no data axis: the split model as it is (parallel/compose.py)
        layout = replicated(shapes, cfg, 1, None)
        layout.params += replicated(frozen, cfg, 1, None).params
    acts, acts_ac, notes = _activations(cfg, layout, mesh, model, stage_rank)
    return MemoryEstimate(spec.name, mesh.world, layout.params, layout.grads, layout.optimizer, acts, acts_ac,
                          list(layout.notes) + notes, mesh.describe(), rank)


def _gathered_kv(m: ModelConfig, micro_batch: int, context: int, precision: str) -> int:
    """What one block's attention keeps beyond its chunk under context parallelism (parallel/context.py): the keys
    and values of the whole sequence where the chunk's own would be (the attention reads them up to its chunk's end,
    a view of the whole gather), and the causal mask of the chunk's queries over them (bool; the most loaded rank,
    the last, attends over all of them; CPU's SDPA materialises it)."""
    if context == 1:
        return 0
    t, chunk = m.seq_len, m.seq_len // context
    act = 4 if precision == "fp32" else 2
    return 2 * act * m.d_model * micro_batch * (t - chunk) + chunk * t


def _gpt_split_activations(cfg: Config, linears: str, mesh: MeshLayout, model: nn.Module,
                           stage_rank: int) -> tuple[int, int, list[str]]:
    """The reference GPT's activations on one rank of a pipeline x tensor layout: each micro-batch the schedule
    keeps in flight there (placement.in_flight) holds what its stage saves, tensor-split as gpt_activation_bytes
    says; the first stage also holds the step's token ids, one tensor that the pipeline cuts into micro-batches."""
    p, m, micro = cfg.parallel, cfg.model, cfg.data.micro_batch_size
    stages = placement.rank_stages(mesh, p, stage_rank)
    last = pipeline.stage_count(p, mesh.pipeline) - 1
    bounds = pipeline.stage_bounds(model, last + 1, p.pipeline_split)
    microbatches = cfg.data.global_batch_size // (mesh.data * micro) if mesh.pipeline > 1 else 1
    chunk = dataclasses.replace(m, seq_len=m.seq_len // mesh.context)  # (context parallelism: this rank's chunk)
    frozen = frozen_parts(model)
    trained = [max(0, high - max(low, frozen.blocks)) for low, high in bounds]  # the blocks that keep activations
    out, counts, exact = [], [], True
    for ac in (False, True):
        gathered = 0 if ac else _gathered_kv(m, micro, mesh.context, p.precision)
        sizes = tuple(gathered * trained[stage] +
                      gpt_activation_bytes(chunk, micro, ac, p.precision, linears, tensor=mesh.tensor,
                                           sequence_parallel=p.sequence_parallel,
                                           split_logits=tensor.splits_logits(p, mesh, m.vocab_size),
                                           blocks=trained[stage], embeds=stage == 0 and frozen.embeds,
                                           head=stage == last, ids=mesh.pipeline == 1, head_trains=frozen.head)
                      for stage in stages)
        chunks, exact = placement.in_flight(p.pipeline_schedule, mesh.pipeline, stage_rank, microbatches, sizes) \
            if mesh.pipeline > 1 else ([0], True)
        counts.append(len(chunks))
        out.append(sum(sizes[c] for c in chunks)
                   + (8 * microbatches * micro * m.seq_len if 0 in stages and frozen.embeds and mesh.pipeline > 1
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


# ----------------------------------------------------------------------------------------------
# Measurement on a real backend


def _grads(params) -> list:
    return [local_tensor(p.grad) for p in params if p.grad is not None]


def _key(t: torch.Tensor) -> tuple[int, int, int]:
    """A tensor's place: its storage, offset and size (views of one tensor count once)."""
    return t.untyped_storage().data_ptr(), t.storage_offset(), t.numel()


def _tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        t = local_tensor(t)
        key = _key(t)
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
            storage = local_tensor(obj).untyped_storage()
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


class SavedPeak:
    """Saved-tensor hooks that keep the bytes autograd holds for backward, live, and their peak: a storage counts
    from the first time a graph saves it until the last graph node holding it is freed (its backward has run).
    Parameters are not activations: a parameter, a view of one (FSDP2 saves transposed views of its gathered
    parameters), or a tensor on a parameter's storage (a tensor-parallel weight's local shard) is left out."""

    def __init__(self, param_ptrs: set[int]):
        self.param_ptrs, self.holders, self.sizes = param_ptrs, {}, {}
        self.live = self.peak = 0

    def pack(self, t: torch.Tensor):
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return t
        storage = local_tensor(t).untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.param_ptrs or not storage.nbytes():
            return t
        # held detached: a saved output's own tensor would point back at the node that saves it, a cycle that
        # only that node's backward breaks (autograd restores the graph's links when it unpacks)
        return _Held(self, t.detach(), ptr, storage.nbytes())

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _Held:
    """One saved tensor; autograd drops it when the node that saved it is freed."""

    def __init__(self, peak: SavedPeak, tensor: torch.Tensor, ptr: int, nbytes: int):
        self.peak, self.tensor, self.ptr = peak, tensor, ptr
        holders = peak.holders.get(ptr, 0)
        if not holders:
            peak.sizes[ptr] = nbytes
            peak.live += nbytes
            peak.peak = max(peak.peak, peak.live)
        peak.holders[ptr] = holders + 1

    def __del__(self):
        peak = self.peak
        peak.holders[self.ptr] -= 1
        if not peak.holders[self.ptr]:
            del peak.holders[self.ptr]
            peak.live -= peak.sizes.pop(self.ptr)


def measure(build, batch) -> dict[str, int]:
    """Build a backend with `build()`, run one step of `batch` (or of a list of micro-batches, accumulated: all
    but the last with sync=False) and return the bytes this rank holds: params, grads (after backward),
    optimizer state (after the step: its state, plus any tensor it steps that is not a model parameter, i.e. a
    master copy) and activations: the peak of the bytes autograd held saved for backward at once during the
    step (`SavedPeak`). Without a pipeline that is what one micro-batch's forward saves (the next forward starts
    after the previous backward freed it); under a pipeline schedule it is the most this stage held in flight.

    The grads also count those that the micro-batches before the last accumulated into other tensors than the final
    gradients: under DDP (ddp, zero1) the step cleared the gradients to None, and they are held beside DDP's
    buckets until the last micro-batch copies them in.

    An engine strategy (deepspeed) keeps gradients in buffers of its own rather than in `param.grad`: there,
    grads are every tensor storage reachable from the engine (or a parameter's `.grad`) after backward that is
    neither a parameter, a buffer nor a master copy."""
    backend = build()
    params = list(backend.model.parameters())
    owned = params + [p.ds_tensor for p in params if hasattr(p, "ds_tensor")]  # ZeRO-3's partitions
    param_ptrs = {local_tensor(p).untyped_storage().data_ptr() for p in owned}
    saved = SavedPeak(param_ptrs)
    batches = batch if isinstance(batch, list) else [batch]
    accumulated = []  # the gradients held after each micro-batch before the last, by storage
    with saved.hooks():
        for i, micro in enumerate(batches):
            backend.forward_backward(micro, sync=i == len(batches) - 1, values=False)
            if i < len(batches) - 1:
                accumulated.append({_key(g): g.numel() * g.element_size() for g in _grads(params)})
    engine = getattr(backend.prepared, "engine", None)
    if engine is None:
        final = _grads(params)
        grads = _tensor_bytes(final)
        # gradients accumulated before the last micro-batch into other storages than the final ones were held
        # beside those (DDP's buckets exist from the start: parallel/ddp.py, with_buckets); elsewhere they are the
        # same tensors and add nothing
        ptrs = {g.untyped_storage().data_ptr() for g in final}
        grads += max((sum(n for key, n in held.items() if key[0] not in ptrs) for held in accumulated), default=0)
    else:  # classified after the step, once the master copies are known
        held = _reachable_storages([engine, *(p.grad for p in params)])
    backend.optim_step()
    optimizer = getattr(backend.optimizer, "optim", backend.optimizer)  # ZeroRedundancyOptimizer: this rank's
    # what it stepped: its groups' tensors and its state's keys (DeepSpeed ZeRO-3 fills the groups only during
    # the step); those that are not parameters are master copies
    stepped = [t for t in [*(t for group in optimizer.param_groups for t in group["params"]), *optimizer.state]
               if local_tensor(t).untyped_storage().data_ptr() not in param_ptrs]
    if engine is not None:
        skip = param_ptrs | {local_tensor(t).untyped_storage().data_ptr() for t in [*stepped, *backend.model.buffers()]}
        grads = sum(n for ptr, n in held.items() if ptr not in skip)
    state = [v for per_param in optimizer.state.values() for v in per_param.values() if torch.is_tensor(v)]
    return {"params": _tensor_bytes(owned), "grads": grads, "optimizer": _tensor_bytes(state + stepped),
            "activations": saved.peak}


# ----------------------------------------------------------------------------------------------
# `disttrain estimate-memory`


def report(cfg: Config, world: int, strategies: list[str], budget_gib: float | None) -> str:
    """A table of per-rank bytes for each strategy, with and without activation checkpointing."""
    mib = 2**20
    estimates = [estimate(cfg, world, strategy) for strategy in strategies]
    split = any(e.layout for e in estimates)  # the model is split: each row says how the ranks lie
    rows = [f"per-rank memory estimate: world size {world}, micro-batch {cfg.data.micro_batch_size}, "
            f"seq_len {cfg.model.seq_len}, precision {cfg.parallel.precision}, optimizer {cfg.optim.name}", "",
            f"{'strategy':<9} {'params':>9} {'grads':>9} {'optim':>9} {'activ.':>9} {'activ.AC':>9} "
            f"{'total':>9} {'total AC':>9}  (MiB)" + ("  fits" if budget_gib else "") + ("  layout" if split else "")]
    notes = []
    for strategy, e in zip(strategies, estimates, strict=True):
        cells = [e.params, e.grads, e.optimizer, e.activations, e.activations_ac, e.total(False), e.total(True)]
        text = " ".join(f"{c / mib:>9.1f}" if c is not None else f"{'n/a':>9}" for c in cells)
        fits = ""
        if budget_gib:
            budget = budget_gib * 2**30
            fits = "  " + ("yes" if (e.total(False) or 0) <= budget else
                           "with AC" if (e.total(True) or 0) <= budget else "no")
        rows.append(f"{strategy:<9} {text}{fits}" + (f"  {e.layout}" if split else ""))
        notes += [n for n in e.notes if n not in notes]
    rows += ["", *(f"note: {n}" for n in notes),
             "Steady-state bytes per rank; allocator caches, communication buffers and temporaries come on top."]
    return "\n".join(rows)
