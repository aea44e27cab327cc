"""What a strategy is: a `StrategySpec` (its name, `apply`, option checks, memory layout and capability flags)
and the `Prepared` model that `apply` returns, which carries the strategy's own backward and step.

The backend has one step path and never asks which strategy it has:

    prepared.forward_backward(inputs, loss_terms, on_loss, sync, autocast)  # every micro-batch
    grad_norm, applied = prepared.step(factor, skip, need_norm)           # once per optimizer step

(`factor` and `skip` as device tensors where `prepared.steps_on_device(device)`: the step is then queued whole, and its
norm and outcome come back as device tensors, read by the backend once with the step's totals.)

`Prepared` implements the torch-native default (normalise, clip, GradScaler unscale/step/update) in one
place; an engine that owns backward and step (DeepSpeed, `parallel/deepspeed/`) overrides `backward`, `step`
and the state dict; a pipeline schedule, which runs forward and backward together over all micro-batches of
a step, overrides `forward_backward` (docs/architecture.md, "How a pipeline strategy plugs in").
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from disttrain.config import Config
    from disttrain.parallel.layout import MemoryLayout


@dataclass(frozen=True)
class StrategySpec:
    """Everything the rest of disttrain knows about one strategy. Config validation, the memory estimator,
    `estimate-memory`, `verify` and the benchmarks read these fields and never name a strategy."""

    name: str
    apply: Callable[..., Prepared]
    """apply(model, runtime, parallel_cfg) -> Prepared: wraps/shards the model on this rank."""
    summary: str
    """One line for `disttrain config --list` and the docs."""
    memory: Callable[..., MemoryLayout]
    """memory(shapes, cfg, world, rank) -> MemoryLayout: per-rank bytes of parameters, gradients and optimizer
    state (see parallel/layout.py); `rank=None` means the most loaded rank. A strategy with `data_axes` is also
    called, under a pipeline / tensor layout, as memory(shapes, cfg, data, data_rank, mesh=MeshLayout), as `apply`
    gets `mesh=`: the shapes are one rank's stage and tensor shard (parallel/placement.py), `data` the
    data-parallel degree."""
    check: Callable[[Config, int], None] | None = None
    """check(cfg, world): the strategy's own option checks, raising a one-line ConfigError. It receives the
    whole config because some engines tie their options to the batch (DeepSpeed's JSON batch keys)."""
    needs_group: bool = True
    """Runs on a process group (formed even at world size 1, e.g. under `torchrun --nproc-per-node 1`)."""
    max_world: int = 0
    """Largest world size it runs on (0: any)."""
    shards_parameters: bool = False
    """Parameters are sharded across ranks (checkpoints go through DCP, one shard per rank)."""
    sharded_start: Callable[[Any], bool] | None = None
    """sharded_start(parallel_cfg): a model whose parameters are on the meta device (`hf:DIR`) is applied to this
    strategy before it is materialised, so each rank allocates only its part (models/meta.py). None: as
    `shards_parameters` says."""
    data_axes: Callable[[Any, int], tuple[int, int]] | None = None
    """data_axes(parallel_cfg, data) -> (replicate, shard): how it lays out `data` data-parallel ranks when it
    composes with pipeline and tensor parallelism (parallel/mesh.py); None: it does not compose with them."""
    options: frozenset[str] = frozenset()
    """Strategy-specific `parallel.*` settings it reads; any other one set away from its default is an error."""
    package: str = ""
    """An optional dependency it needs (`pip install 'disttrain[<package>]'`); empty: none."""
    aliases: tuple[str, ...] = ()
    """Other names users type for it (turned into `name` when the config is read)."""
    variants: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """(label, `--set` overrides) of the option sets the benchmarks measure separately (empty: the defaults)."""

    def runs_on(self, world: int) -> bool:
        return not self.max_world or world <= self.max_world

    def starts_sharded(self, parallel) -> bool:
        if getattr(parallel, "pipeline", 1) > 1:  # a stage reads its own weights (parallel/pipeline.py)
            return True
        return self.sharded_start(parallel) if self.sharded_start else self.shards_parameters


@dataclass
class Prepared:
    """A model made ready for one strategy, with the torch-native backward and step.

    module:   what forward/backward run on (e.g. the DDP wrapper).
    model:    the plain user model underneath (state dicts, optimizer parameter groups, evaluation).
    no_sync:  context manager for accumulation micro-batches whose gradients must not be reduced yet.
    make_optimizer: builds the optimizer from the user's factory (strategies that shard optimizer
              state wrap it here).
    state_dict / load_state_dict: (model, optimizer) <-> a full, strategy-independent state (parameter
              names as in the plain model; optimizer state keyed by those names), so a checkpoint saved
              under one strategy and world size loads under any other.
    """

    module: torch.nn.Module
    model: torch.nn.Module
    no_sync: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    make_optimizer: Callable[[Callable[[Any], Any]], Any] | None = None
    grads_averaged_over: int = 1
    """Ranks whose gradients the strategy averages (DDP: world size); the step turns the mean back into a
    sum before dividing by the global item count."""
    state_dict: Callable[[Any], tuple[dict, dict]] | None = None
    load_state_dict: Callable[[Any, dict, dict], None] | None = None
    checkpoint_target: Callable[[str, Any, Any], Any] | None = None
    """For sharded checkpoints: the tensor a saved tensor (key, global size, dtype) is loaded into
    (None: a full tensor on every rank)."""
    optimizer: Any = None
    """Set by `build_optimizer`."""
    scaler: Any = None
    """fp16's loss scaler (None otherwise), set by `build_optimizer`."""
    grad_clip: float = 0.0
    comm: Any = None
    """The strategy's `CommMeter` (parallel/comm.py): time and bytes of its gradient/parameter collectives per step;
    None where they are not measured (no communication; PowerSGD on CUDA; devices other than CPU and CUDA)."""
    data_parallel: tuple[int, int] | None = None
    """(data-parallel degree, this rank's index on it): which share of each global batch this rank reads. None:
    (world size, rank). Ranks that split the model between them (pipeline stages, tensor shards) read the same."""
    counts_loss: bool = True
    """Whether this rank's loss and item count join the step's global totals: one rank per data shard does (the
    others compute the same loss, or none)."""
    split_logits: Any = None
    """Tensor parallelism's loss parallel (parallel/tensor.py): the context in which forward, disttrain's own loss
    and backward run on logits split by vocabulary. None: the model's logits are whole tensors."""
    context: Any = None
    """Context parallelism (parallel/context.py): cuts each batch to this rank's pieces of every sequence, and is the
    mode under which forward and backward attend over the whole sequence. None: sequences are whole."""
    sequence_multiple: int = 1
    """Each batch's sequences are right-padded to a multiple of this many tokens (sequence parallelism's tensor
    degree, for equal shares; a pipeline and a context split pad their own)."""
    cuts_context: bool = False
    """`forward_backward` takes whole micro-batches and cuts them into the context split's pieces itself, once a
    step's are all known (a pipeline: every micro-batch at the step's widest, one shape for its stages); its
    `loss_terms` then takes the cut as a second argument (a function of the whole batch)."""
    norm_group: Any = None
    """A process group whose ranks hold different parameters that no DTensor spans (pipeline stages): the squared
    gradient norm is summed over it. None: the norm is complete on each rank."""
    local_state: bool = False
    """`state_dict` holds only this rank's part of the model (pipeline stages; its tensors need not be DTensors):
    checkpoints join the ranks' parts, and `load_state_dict` takes what this rank holds from a full state."""
    norm_skip: set = field(default_factory=set)
    """ids of parameters left out of the norm because another rank of `norm_group` counts them (a tied weight's
    copy on the last pipeline stage)."""
    partition_module: Callable[[Any], None] | None = None
    """For a sharded start whose engine partitions parameters itself (DeepSpeed ZeRO-3): called on each module,
    children first, once its parameters are real; None: the strategy has sharded the meta model already."""

    def __post_init__(self):
        self._placed: tuple | None = None  # ((optimizer id, device), every trainable parameter on that device)
        if self.state_dict is None:
            from disttrain.parallel.state import full_state_dict_fns

            fns = full_state_dict_fns(self.model)
            self.state_dict, self.load_state_dict = fns["state_dict"], fns["load_state_dict"]

    def build_optimizer(self, factory: Callable[[Any], Any], grad_clip: float = 0.0, scaler=None):
        """The optimizer the step drives (and the LR schedule is attached to)."""
        self.grad_clip, self.scaler = grad_clip, scaler
        if scaler is not None:  # the sharded GradScaler hands fused kernels a found_inf of shape [1]: refused
            factory = unfused(factory)
        self.optimizer = self.make_optimizer(factory) if self.make_optimizer else factory(self.model)
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        self._placed = None
        return self.optimizer

    def forward_backward(self, inputs: Any, loss_terms: Callable, on_loss: Callable, sync: bool,
                         autocast: contextlib.AbstractContextManager) -> tuple[torch.Tensor, torch.Tensor]:
        """One micro-batch: forward (`inputs(module)` calls the module with the batch's arguments, batches.py)
        and `loss_terms(outputs) -> (loss_sum, count)` under `autocast`, then
        `on_loss(loss_sum, count)` (the backend's bookkeeping, before backward so that its all-reduce overlaps
        it; it returns the tensor to back-propagate, e.g. the loss times fp16's scale), then backward.
        `sync=False`: under `no_sync` (gradients stay local until the step's last micro-batch)."""
        with contextlib.nullcontext() if sync else self.no_sync(), self.split_logits or contextlib.nullcontext():
            with autocast:
                loss_sum, count = loss_terms(inputs(self.module))
            self.backward(on_loss(loss_sum, count), sync)
        return loss_sum, count

    def backward(self, loss: torch.Tensor, sync: bool) -> None:
        loss.backward()

    def steps_on_device(self, device: Any) -> bool:
        """Whether `step` takes its factor and skip flag as tensors on `device` (and returns the norm and whether it
        applied the update as ones): the host then queues the whole step without waiting for the device, as a
        hand-written loop does, and torch's fused Adam/AdamW kernel skips a refused update on the device
        (`found_inf`, as under GradScaler). Only where every trainable parameter is on `device` (not FSDP2's
        `cpu_offload` on a GPU, whose CPU kernel would read the flag before its copy from the GPU lands), never
        under fp16's scaler (its own step reads the device), and not for other optimizers: torch's foreach and
        single-tensor ones have no such kernel, nor have ZeRO-1's and DeepSpeed's, and fused SGD stores the
        momentum buffers it made for a skipped first update uninitialised."""
        import torch

        optimizer = self.optimizer
        if (self.scaler is not None or not isinstance(optimizer, torch.optim.Adam)
                or not getattr(optimizer, "_step_supports_amp_scaling", False)
                or not all(group.get("fused") for group in optimizer.param_groups)):
            return False
        key = (id(optimizer), torch.device(device))
        if self._placed is None or self._placed[0] != key:  # (asked every step: DTensor's to_local is not free)
            placed = all((p.to_local() if hasattr(p, "to_local") else p).device == key[1] for p in self._params)
            self._placed = (key, placed)
        return self._placed[1]

    def _device(self) -> Any:
        """Where this rank's trainable parameters live (their local shards'), for a norm with no gradient to take."""
        import torch

        if not self._params:  # (no trainable parameter: the rank's GPU where it has one, as its collectives need)
            return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_initialized() else None
        first = self._params[0]
        return (first.to_local() if hasattr(first, "to_local") else first).device

    def step(self, factor: Any, skip: Any = False, need_norm: bool = True) -> tuple[Any, Any]:
        """Multiply the reduced gradients by `factor` (the global-mean normalisation), clip to `grad_clip`,
        and step the optimizer unless `skip` or the gradients are non-finite; then clear them. Returns
        (norm of the normalised gradients, applied); the norm is NaN when neither clipping, `need_norm` nor
        the non-finite check needs it. The norm is the same on every rank (replicated gradients, or a norm
        reduced over the shards). `factor` a device tensor (float64, 0-dim) and `skip` a boolean one, where
        `steps_on_device(device)`: the same step, queued without reading the device, returning device tensors."""
        import torch

        if isinstance(factor, torch.Tensor):
            return self._step_queued(factor, skip, need_norm)
        optimizer, scaler = self.optimizer, self.scaler
        if scaler is not None:
            scaler.unscale_(optimizer)  # records inf/NaN (agreed across ranks, see precision.py)
        grads = [p.grad for p in self._params if p.grad is not None]
        norm = math.nan
        # (with a norm_group, a rank whose parameters got no gradient in this step still joins the norm's all-reduce)
        if (grads or self.norm_group is not None) and (need_norm or self.grad_clip > 0):
            # one pass: the norm of the raw sums gives the mean's norm (x factor); normalisation and the clip
            # coefficient are applied together, to each rank's local shards (no DTensor dispatch)
            normed = [p.grad for p in self._params if p.grad is not None and id(p) not in self.norm_skip]
            norm = total_norm(normed, self.norm_group, self._device()) * factor
            if self.grad_clip > 0 and math.isfinite(norm):
                factor *= min(1.0, self.grad_clip / (norm + 1e-6))
        if grads and factor != 1.0:
            torch._foreach_mul_([g.to_local() if hasattr(g, "to_local") else g for g in grads], factor)
        if scaler is not None:
            before = scaler.get_scale()
            scaler.step(optimizer)  # skips when unscale_ found inf/NaN
            scaler.update()
            applied = scaler.get_scale() >= before
        else:
            applied = not skip and (math.isfinite(norm) or not (need_norm or self.grad_clip > 0))
            if applied:
                optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return norm, applied

    def drop_gradients(self, optimizer) -> None:
        """Clear the step's gradients without an update (a step refused before `step`)."""
        optimizer.zero_grad(set_to_none=True)

    def _step_queued(self, factor: Any, skip: Any, need_norm: bool) -> tuple[Any, Any]:
        """`step` with nothing read back: the clip coefficient is a device tensor, and a refused update (`skip`,
        or non-finite gradients) is skipped by the fused kernel (`found_inf`; its step count is not advanced)."""
        import torch

        optimizer = self.optimizer
        grads = [p.grad for p in self._params if p.grad is not None]
        refused = torch.as_tensor(skip, device=factor.device)
        if (grads or self.norm_group is not None) and (need_norm or self.grad_clip > 0):
            normed = [p.grad for p in self._params if p.grad is not None and id(p) not in self.norm_skip]
            norm = squared_norm(normed, self.norm_group, factor.device).sqrt() * factor
        else:
            norm = torch.full((), math.nan, dtype=torch.float64, device=factor.device)
        if need_norm or self.grad_clip > 0:
            finite = torch.isfinite(norm)
            refused = refused | ~finite
            if self.grad_clip > 0:
                factor = factor * torch.where(finite, (self.grad_clip / (norm + 1e-6)).clamp(max=1.0), 1.0)
        if grads:
            local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
            torch._foreach_mul_(local, factor.float())  # (float32: the fast path for float32 gradients, and the
            # factor as precise as the host step's Python float, which the kernel computes with in float32)
        optimizer.found_inf = refused.to(torch.float32)
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
        optimizer.zero_grad(set_to_none=True)
        return norm, ~refused


def total_norm(grads: list, group=None, device=None) -> float:
    """The 2-norm of all `grads` on every rank (`squared_norm`, read back)."""
    return math.sqrt(squared_norm(grads, group, device).item())


def squared_norm(grads: list, group=None, device=None) -> Any:
    """The squared 2-norm of all `grads` on every rank, a float64 device tensor. Plain tensors and DTensors (on
    several meshes or placements: tensor parallelism leaves norms and positions whole) are normed in groups of one
    kind, each DTensor group reduced over its mesh; `group` then sums the squares over ranks that hold other
    parameters (pipeline stages). No `grads` (a stage whose parameters got no gradient): 0, on `device`."""
    import torch

    kinds: dict[Any, list] = {}
    for g in grads:
        key = (g.device_mesh, tuple(g.placements)) if hasattr(g, "device_mesh") else None
        kinds.setdefault(key, []).append(g)
    squares = []
    for same in kinds.values():
        norm = torch.nn.utils.get_total_norm(same)
        squares.append((norm.full_tensor() if hasattr(norm, "full_tensor") else norm).double() ** 2)
    square = torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float64, device=device)
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(square, group=group)
    return square


def unfused(factory: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """`factory`, but with torch's fused optimizer kernel (optim.py picks it where torch has one) turned off, for
    where it cannot run: the optimizer is rebuilt (before any step, so with no state) with torch's default
    implementation, the same numbers to ~1e-7."""

    def build(model):
        optimizer = factory(model)
        if not optimizer.defaults.get("fused"):
            return optimizer
        groups = [{**group, "fused": None} for group in optimizer.param_groups]
        return type(optimizer)(groups, **{**optimizer_kwargs(optimizer), "fused": None})

    return build


def optimizer_kwargs(optimizer) -> dict[str, Any]:
    """The constructor arguments among `optimizer.defaults` (which may also hold internal keys), to build another
    optimizer of the same class and settings."""
    import inspect

    accepted = inspect.signature(type(optimizer).__init__).parameters
    return {k: v for k, v in optimizer.defaults.items() if k in accepted}
