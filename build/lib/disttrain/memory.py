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
                            fp32 on CPU; with activation checkpointing only each block's input is kept;
                            activations.py); `None` for other models

Measurement: tensor bytes of local parameters, gradients and optimizer state, and the unique storages that
autograd saves during a forward (saved-tensor hooks), parameters excluded. DeepSpeed keeps gradients and master
copies in buffers of its own: those are found by walking the engine's objects (see `measure`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from disttrain.activations import activations
from disttrain.config import Config, ModelConfig
from disttrain.errors import ConfigError
from disttrain.parallel import placement, registry
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


def frozen_share(model_cfg: ModelConfig) -> float | None:
    """The share of the parameters model.freeze keeps from training, its patterns matched on the meta-built model
    (a ConfigError where they match nothing or everything); None where the model cannot be built on the meta
    device (a factory of the user's: the workers match them)."""
    try:
        params = list(meta_model(model_cfg).parameters())
    except ConfigError:
        raise
    except Exception:
        return None
    return sum(p.numel() for p in params if not p.requires_grad) / max(1, sum(p.numel() for p in params))


def param_shapes(model_cfg: ModelConfig) -> list[torch.Size]:
    """Shapes of the model's trainable parameters (tied ones once), built on the meta device: no memory."""
    return [p.shape for p in meta_model(model_cfg).parameters() if p.requires_grad]


def estimate(cfg: Config, world: int, strategy: str | None = None, rank: int | None = None) -> MemoryEstimate:
    """Bytes per rank, from the strategy's memory layout (its spec) on the layout the config asks for
    (parallel.pipeline, parallel.tensor); where ranks differ (pipeline stages, zero1, deepspeed), `rank`'s or,
    with None, the most loaded one's."""
    spec = registry.resolve(strategy or cfg.parallel.strategy, world)
    mesh = layout_for(cfg.parallel, world, spec)
    if mesh.model_parallel:
        return _split_estimate(cfg, spec, mesh, rank)
    model = meta_model(cfg.model)
    trained, frozen = ([tuple(p.shape) for p in model.parameters() if p.requires_grad == t] for t in (True, False))
    layout = spec.memory(trained, cfg, world, rank)
    if frozen:  # frozen parameters (model.freeze, or the model's own) are held, with no gradient or state
        layout.params += spec.memory(frozen, cfg, world, rank).params
    acts, acts_ac, notes = activations(cfg, layout.linears, model)
    return MemoryEstimate(spec.name, world, layout.params, layout.grads, layout.optimizer, acts, acts_ac,
                          list(layout.notes) + notes)


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
    acts, acts_ac, notes = activations(cfg, layout.linears, model, mesh, stage_rank)
    return MemoryEstimate(spec.name, mesh.world, layout.params, layout.grads, layout.optimizer, acts, acts_ac,
                          list(layout.notes) + notes, mesh.describe(), rank)


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
