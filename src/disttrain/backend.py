"""TrainingBackend: one implementation of "a training step under strategy S and precision P".

Used three ways: by the Trainer's loop, directly in your own loop (`create_backend`), and remotely by
the TrainingService. Calls:

    metrics = backend.forward_backward(batch, loss_fn)   # accumulates gradients (a micro-batch)
    metrics = backend.optim_step()                        # normalise, clip, step, schedule, zero_grad

Normalisation: a loss function returns a *sum* and the number of items it covers (valid tokens for a
language model), or a mean (then the count is the batch size). Gradients of the sums accumulate over
micro-batches; `optim_step` divides by the valid items of the whole global batch, summed over
micro-batches and ranks. So micro-batching, padding and world size never change the gradient.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from disttrain.batches import ModelCall, batch_size, to_device
from disttrain.config import DistConfig, ParallelConfig
from disttrain.errors import ConfigError, UserError
from disttrain.losses import causal_lm_loss, cut_logits, default_loss, lm_loss, shifted, takes_split_logits
from disttrain.models.hf import is_hf_model
from disttrain.models.meta import has_meta_parameters, materialize
from disttrain.optim import OptimizerFactory, align_groups
from disttrain.parallel import Prepared, compose, registry
from disttrain.parallel.activation_checkpoint import apply_activation_checkpointing, check_compile, compile_blocks
from disttrain.parallel.context import pad_to_shares
from disttrain.parallel.fsdp import reshard_gathered
from disttrain.precision import Precision, get_precision
from disttrain.runtime import Runtime, detect_launch, init_runtime
from disttrain.totals import StepTotals

LossOutput = torch.Tensor | tuple[torch.Tensor, torch.Tensor | int]
LossFn = Callable[[Any, Any], LossOutput]


class NonFiniteError(UserError, RuntimeError):
    """Training produced a non-finite loss or gradient (or too many skipped steps); the message says where."""


class EmptyBatchError(UserError, RuntimeError):
    """A global batch with no item to learn from (every label ignored, or a loss that counted none): the data's
    fault, so exit 2. The step was refused and the backend can go on with the next batch."""

    exit_code = 2


OPTIMIZER_IMPLEMENTATION = ("fused", "foreach", "capturable", "differentiable")
"""Keys of torch's optimizer groups that choose how the update is computed, not what it is."""


def place_steps(optimizer: Any, group: dict) -> None:
    """Put each parameter's step count of `group` where its implementation reads it, as torch's `load_state_dict`
    does for the saved group's implementation: on the parameter's device in float32 for a fused or capturable one
    (torch's CUDA fused kernel reads it there, unchecked), on the host otherwise."""
    on_device = bool(group.get("fused") or group.get("capturable"))
    for param in group["params"]:
        state = optimizer.state.get(param)
        step = state.get("step") if isinstance(state, dict) else None  # (ZeRO-1 keeps None for others' shards)
        if isinstance(step, torch.Tensor):
            local = param.to_local() if hasattr(param, "to_local") else param
            state["step"] = step.to(dtype=torch.float32, device=local.device) if on_device else step.cpu()


class TrainingBackend:
    def __init__(self, prepared: Prepared, runtime: Runtime, precision: Precision, scheduler=None,
                 loss_fn: LossFn | None = None, on_nonfinite: str = "stop", max_consecutive_skips: int = 25,
                 strategy: str = ""):
        """Use `create_backend`; `prepared` carries the model, its optimizer and the strategy's step."""
        self.prepared, self.optimizer, self.runtime = prepared, prepared.optimizer, runtime
        self.strategy = strategy
        """The strategy's name, `auto` resolved (e.g. for a checkpoint's manifest)."""
        self.precision, self.scheduler = precision, scheduler
        self.loss_fn = loss_fn or default_loss(prepared.model)
        self.model_call = ModelCall(prepared.model)
        """How a batch becomes the model's arguments (batches.py)."""
        self.on_nonfinite, self.max_consecutive_skips = on_nonfinite, max_consecutive_skips
        self.on_phase: Callable[[str], None] = lambda phase: None  # e.g. the rank's status file (monitor.py)
        self.before_update: Callable[[], None] = lambda: None
        """Called before `optim_step` changes any parameter or optimizer state (e.g. an async checkpoint
        still copying them)."""
        self.scaler = prepared.scaler
        self.step = 0
        self.skipped_steps = 0  # total optimizer steps skipped (fp16 overflow, or non-finite with "skip")
        self._consecutive_skips = 0
        self.totals = StepTotals(runtime, prepared)
        """What this step's micro-batches added up, and their one all-reduce (totals.py)."""

    @property
    def model(self) -> nn.Module:
        """The plain model (unwrapped), e.g. for saving weights."""
        return self.prepared.model

    @property
    def data_parallel(self) -> tuple[int, int]:
        """(data-parallel degree, this rank's index on it): this rank reads shard `index` of `degree` of every
        global batch (ranks that split the model between them read the same shard)."""
        return self.prepared.data_parallel or (self.runtime.world_size, self.runtime.rank)

    def loss_terms(self, outputs: Any, batch: Any, loss_fn: LossFn | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed loss, item count) of `outputs` for `batch`, whichever form the loss function returns."""
        batch = to_device(batch, self.runtime.device)
        loss_fn = loss_fn or self.loss_fn
        split = self.prepared.split_logits
        if split is None:
            result = loss_fn(outputs, batch)
        else:  # logits split by vocabulary: disttrain's own losses take them so, any other gets them whole
            with split:
                result = loss_fn(outputs if takes_split_logits(loss_fn) else split.whole(outputs), batch)
        if isinstance(result, tuple):
            loss_sum, count = result
            return loss_sum, torch.as_tensor(count, dtype=torch.float64, device=self.runtime.device)
        if self.prepared.context is not None:
            raise ConfigError("parallel.context > 1: the loss function returned a mean, which cannot be weighted over "
                              "pieces of a sequence; return (summed loss, token count), as disttrain's own losses do")
        count = batch_size(batch)  # a mean over the batch: weight it by its size
        return result * count, torch.tensor(float(count), dtype=torch.float64, device=self.runtime.device)

    def forward_backward(self, batch: Any, loss_fn: LossFn | None = None, *, sync: bool = True,
                         values: bool = True) -> dict:
        """Forward and backward one micro-batch, accumulating gradients.

        `sync=False` marks a micro-batch that is not the last of its optimizer step, so the strategy may
        skip gradient communication (DDP `no_sync`). The last micro-batch before `optim_step` must sync.
        `values=False` returns {} and does not itself read anything back from the device, so on a GPU the host
        goes on queuing work instead of waiting for this micro-batch's backward (the Trainer's loop: its step's loss
        comes from `optim_step`).
        """
        batch, loss_fn = self._chunk(to_device(batch, self.runtime.device, self.precision.param_dtype), loss_fn,
                                     cut=not self.prepared.cuts_context)
        self.prepared.module.train()
        self.on_phase("forward")
        joined: list[torch.Tensor] = []
        totals = self.totals

        def loss_terms(outputs: Any, cut: Callable[[Any], Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
            return self.loss_terms(outputs, batch if cut is None else cut(batch), loss_fn)

        def on_loss(loss_sum: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
            # this micro-batch joins the step's totals once its backward has run (a backward that raises
            # leaves them as they were); the last one starts their all-reduce now, to overlap its backward
            loss_sum_d = loss_sum.detach().double()
            nonfinite = torch.maximum(totals.nonfinite, (~torch.isfinite(loss_sum_d)).double())
            if not self.prepared.counts_loss:  # another rank counts this data shard's loss (pipeline, tensor)
                loss_sum_d, count = torch.zeros_like(loss_sum_d), torch.zeros_like(count)
            joined.extend([loss_sum_d, nonfinite, count])
            if sync:
                totals.start_with(*joined)
            self.on_phase("backward")
            return self.scaler.scale(loss_sum) if self.scaler is not None else loss_sum

        autocast = self.precision.autocast(self.runtime.device.type)
        loss_sum, count = self.prepared.forward_backward(self.model_call(batch), loss_terms, on_loss, sync, autocast)
        if joined:  # (a pipeline joins a step's micro-batches at once, on its last: parallel/pipeline.py)
            totals.add(*joined)
        totals.ran(sync)
        if not values:
            return {}
        local_loss, local_count = torch.stack([loss_sum.detach().to(count), count]).tolist()  # one read
        return {"loss": local_loss / max(local_count, 1.0), "count": local_count}

    def optim_step(self, *, grad_norm: bool = True) -> dict:
        """Normalise by the global item count, clip, step the optimizer and the schedule, zero grads.

        `grad_norm=False`: the caller does not need the gradient norm this step (it is NaN in the result), so
        without clipping the step skips that pass over the gradients (and with it the check for non-finite
        gradients whose loss was finite; non-finite losses are always caught)."""
        if self.totals.micro_batches == 0:
            raise RuntimeError("optim_step() called before any forward_backward() in this step")
        if self.totals.unsynced:
            raise RuntimeError("the last forward_backward() before optim_step() ran with sync=False, so its "
                               "gradients were never reduced across ranks; pass sync=True on the last micro-batch")
        self.on_phase("optimizer")
        self.before_update()
        lr = self.optimizer.param_groups[0]["lr"]
        if self.prepared.steps_on_device(self.runtime.device):  # queued whole, read once (as a loop's loss.item())
            loss_sum, count, bad_ranks, stop, norm, applied = self._queued_step(grad_norm)
            self._refuse_if_empty(count)  # (the queued step was refused on the device, its gradients cleared)
            loss, skip = loss_sum / count, bool(bad_ranks)
        else:
            loss_sum, count, bad_ranks, stop = self.totals.parse(self.totals.done().tolist())
            self._refuse_if_empty(count)
            loss = loss_sum / count
            skip = bool(bad_ranks) and self.scaler is None  # under fp16 a non-finite loss is an overflow like others
            if skip and self.on_nonfinite == "stop":
                self._refuse(bad_ranks, loss)  # raises before the strategy touches the parameters
            norm, applied = self.prepared.step(self.prepared.grads_averaged_over / count, skip, grad_norm)
        if not applied and self.scaler is None and self.on_nonfinite == "stop":
            self._refuse(bad_ranks, loss)  # (a queued step has left the parameters as they were)
        skipped = skip or not applied
        self._count_skip(skipped, bad_ranks, loss)
        if self.scheduler is not None and not skipped:
            self.scheduler.step()  # a skipped step does not advance the schedule (as in HF Accelerate)
        self.totals.reset()
        self.step += 1
        out = {"step": self.step, "loss": loss, "grad_norm": norm, "lr": lr, "count": count,
               "skipped": skipped, "skipped_steps": self.skipped_steps, "stop_requested": stop}
        if self.scaler is not None:
            out["loss_scale"] = self.scaler.get_scale()
        return out

    def request_stop(self) -> None:
        """Ask every rank to stop after the current step (e.g. on SIGTERM); `optim_step` reports it, on every
        rank at the same step, as `stop_requested`."""
        self.totals.stop_requested = True

    def _refuse_if_empty(self, count: float) -> None:
        """Refuse a step whose global batch counted no item (nothing to normalise by): its gradients are dropped and
        the step's accumulators reset, so the caller may go on with the next batch; one line says why."""
        if count > 0:
            return
        self.prepared.drop_gradients(self.optimizer)
        self.totals.reset()
        raise EmptyBatchError(f"step {self.step + 1}: the global batch has no valid items (every label is padding "
                              "or ignored, e.g. -100, on every rank); the optimizer did not touch the parameters. "
                              "Check the data's labels, or the item count the loss function returns")

    def _queued_step(self, grad_norm: bool) -> tuple[float, float, list[int], bool, float, bool]:
        """The strategy's step queued on the device from the totals there (`Prepared.steps_on_device`), then the
        totals, the gradient norm and whether the update was applied, read back together: the step's one wait for
        the device, after all of its work is queued. A step refused there (a non-finite loss on any rank, non-finite
        gradients, or no valid items) left the parameters and the optimizer's state as they were."""
        totals = self.totals.done()
        world = self.runtime.world_size
        refused = (totals[2:2 + world].amax() > 0) | (totals[1] <= 0)
        norm, applied = self.prepared.step(self.prepared.grads_averaged_over / totals[1], refused, grad_norm)
        values = torch.cat([totals, norm.reshape(1).double(), applied.reshape(1).double()]).tolist()
        return (*self.totals.parse(values[:-2]), values[-2], values[-1] > 0)

    def _refuse(self, bad_ranks: list[int], loss: float) -> None:
        raise NonFiniteError(self._nonfinite_message(bad_ranks, loss)
                             + ", or train.on_nonfinite = 'skip' to skip such steps")

    def _nonfinite_message(self, bad_ranks: list[int], loss: float) -> str:
        where = (f"the loss was non-finite on rank(s) {', '.join(map(str, bad_ranks))}" if bad_ranks else
                 "the gradients were non-finite (the loss was finite on every rank)")
        return (f"step {self.step + 1}: {where} (loss {loss:g}); the optimizer did not touch the parameters. "
                "Try a lower optim.lr, optim.grad_clip > 0, or parallel.precision = 'fp32'")

    def _count_skip(self, skipped: bool, bad_ranks: list[int], loss: float) -> None:
        """Count a skipped step; too many in a row stop the run, saying why."""
        self._consecutive_skips = self._consecutive_skips + 1 if skipped else 0
        self.skipped_steps += skipped
        if self._consecutive_skips > self.max_consecutive_skips:
            reason = (f"fp16 gradients overflowed; the loss scale fell to {self.scaler.get_scale():g}"
                      if self.scaler is not None else self._nonfinite_message(bad_ranks, loss))
            raise NonFiniteError(
                f"step {self.step + 1}: {self._consecutive_skips} optimizer steps in a row were skipped ({reason}). "
                "The model is producing inf/NaN: lower optim.lr, set optim.grad_clip, use parallel.precision = "
                "'bf16-mixed' or 'fp32', or raise train.max_consecutive_skips")

    def _chunk(self, batch: Any, loss_fn: LossFn | None, cut: bool = True) -> tuple[Any, LossFn | None]:
        """Under context parallelism, this rank's pieces of every sequence, and the loss to take on it (HF's labels
        cross the cut: shifted before it, and taken as pre-shifted); otherwise both as they are. `cut=False`: the
        whole batch, shifted (the strategy cuts it: `Prepared.cuts_context`)."""
        context, multiple = self.prepared.context, self.prepared.sequence_multiple
        if context is None:
            return (pad_to_shares(batch, multiple) if multiple > 1 else batch), loss_fn  # (sequence parallelism)
        context.check(batch)  # (every rank, before any stage runs: a pipeline cuts the batch later)
        if (loss_fn or self.loss_fn) is causal_lm_loss and "labels" in batch:
            batch, loss_fn = shifted(batch), lm_loss
        return context.shard(batch, check=False) if cut else batch, loss_fn

    @torch.no_grad()
    def evaluate(self, batch: Any, loss_fn: LossFn | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(summed loss, item count) of `batch` without gradients, in eval mode, as `loss_terms` gives them, on a
        rank whose loss counts (`Prepared.counts_loss`), else None after its part of the forward (every rank must
        call it the same number of times under sharded strategies). Under context parallelism each rank takes its
        pieces': the whole sequence's logits are never joined."""
        if self.prepared.context is None:
            outputs = self.forward(batch)
            return self.loss_terms(outputs, batch, loss_fn) if self.prepared.counts_loss else None
        batch, loss_fn = self._chunk(to_device(batch, self.runtime.device, self.precision.param_dtype), loss_fn)
        outputs = self._eval_call(batch)
        if not self.prepared.counts_loss and self.prepared.split_logits is None:
            return None  # (a pipeline stage without the head, a tensor rank whose loss another one counts)
        terms = self.loss_terms(outputs, batch, loss_fn)  # (every tensor rank under loss parallel: its collectives)
        return terms if self.prepared.counts_loss else None

    @torch.no_grad()
    def forward(self, batch: Any) -> Any:
        """Forward pass without gradients, in eval mode (every rank must call it the same number of times
        under sharded strategies)."""
        batch = to_device(batch, self.runtime.device, self.precision.param_dtype)
        context = self.prepared.context  # (context parallelism: this rank's pieces, then the whole sequences)
        given = context.shard(batch) if context is not None else self._chunk(batch, None)[0]
        outputs = self._eval_call(given)
        split = self.prepared.split_logits  # (loss parallel's logits split by vocabulary: gathered first)
        outputs = outputs if split is None else split.whole(outputs)
        if context is not None:
            return context.whole(outputs, batch["input_ids"].shape[1])
        if given is not batch:  # (sequence parallelism's padding, cut off)
            return cut_logits(outputs, batch["input_ids"].shape[1])
        return outputs

    def _eval_call(self, batch: Any) -> Any:
        """The model's outputs for `batch` (on the device), in eval mode under the precision's autocast."""
        module = self.prepared.module
        was_training = module.training
        module.eval()
        try:
            with self.precision.autocast(self.runtime.device.type):
                return self.model_call(batch)(module)
        finally:
            module.train(was_training)
            reshard_gathered(module)  # no backward follows to reshard what stays gathered after forward

    def state_dict(self) -> dict[str, Any]:
        """Full, strategy-independent state (every rank gets it; rank 0 saves it)."""
        model_state, optimizer_state = self.prepared.state_dict(self.optimizer)
        state = {"model": model_state, "optimizer": optimizer_state, "step": self.step,
                 "skipped_steps": self.skipped_steps}
        if self.prepared.local_state:  # this rank's stage only: the checkpoint joins the ranks' parts
            state["local_parts"] = True
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        if self.scaler is not None:
            state["grad_scaler"] = self.scaler.state_dict()
        if is_hf_model(self.model):
            state["hf_config"] = json.loads(self.model.config.to_json_string())  # for `ckpt export --format hf`
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a `state_dict()` saved under any strategy and world size. The optimizer keeps the implementation it
        was built with here (a state saved under DeepSpeed, whose optimizer is never fused, leaves a fused one
        fused): torch's `load_state_dict` would take those flags from the saved groups too.

        As torch's `Optimizer.load_state_dict`, the optimizer may keep the given tensors themselves where their device
        and dtype already fit (a checkpoint's are read fresh): to start a second backend from the `state_dict()` of one
        that goes on training, pass `copy.deepcopy(state)`, or both will step the same moments and step counts."""
        built = [{k: g[k] for k in OPTIMIZER_IMPLEMENTATION if k in g} for g in self.optimizer.param_groups]
        groups = self.optimizer.param_groups
        optimizer_state, scheduler_state = align_groups(
            groups, state["optimizer"], state.get("scheduler"),
            self.scheduler.state_dict() if self.scheduler is not None else None)
        if self.scheduler is not None and len((scheduler_state or {}).get("base_lrs", groups)) != len(groups):
            raise ConfigError(f"the checkpoint's learning-rate schedule covers {len(scheduler_state['base_lrs'])} "
                              f"parameter groups and this optimizer has {len(groups)}: resume with the optimizer "
                              "(and model.freeze) it was saved with")  # (its first step would fail, less clearly)
        self.prepared.load_state_dict(self.optimizer, state["model"], optimizer_state)
        inner = getattr(self.optimizer, "optim", None)  # ZeRO-1's local optimizer, the one that steps: torch's
        # load took its flags from the saved groups too and put its step counts on the host
        for optimizer in (self.optimizer, *([inner] if isinstance(inner, torch.optim.Optimizer) else [])):
            for group, flags in zip(optimizer.param_groups, built, strict=False):
                group.update(flags)
                place_steps(optimizer, group)
        if self.scaler is not None and "grad_scaler" in state:
            self.scaler.load_state_dict(state["grad_scaler"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        if self.scheduler is not None and scheduler_state is not None:
            self.scheduler.load_state_dict(scheduler_state)
        self.step = int(state["step"])


def create_backend(model: nn.Module, optimizer_factory: OptimizerFactory, parallel: ParallelConfig | None = None, *,
                   runtime: Runtime | None = None, dist: DistConfig | None = None, scheduler_factory=None,
                   grad_clip: float = 0.0, loss_fn: LossFn | None = None, on_nonfinite: str = "stop",
                   max_consecutive_skips: int = 25) -> TrainingBackend:
    """Place `model` on this rank's device, apply the strategy, and build optimizer and schedule: the one
    composition of a training step, used by the Trainer, the TrainingService's workers and your own loop.

    A model whose parameters are on the meta device (`model.name = "hf:DIR"`, models/meta.py) is materialised
    after a sharding strategy has sharded it, each rank allocating and reading only its shards; before the
    strategy otherwise.

    `parallel` names the strategy and the precision (`ParallelConfig(strategy="fsdp", precision="bf16-mixed")`;
    default: `auto` in fp32). `runtime` defaults to one detected from the environment; a strategy that needs a
    process group forms it, under torchrun at any world size (`dist` configures it). `optimizer_factory(model)
    -> Optimizer` receives the plain model; `scheduler_factory(optimizer)` is optional.
    """
    parallel = parallel or ParallelConfig()
    if parallel.compile:  # (refused before the model or the process group is touched)
        check_compile(parallel)
    world = runtime.world_size if runtime is not None else detect_launch(os.environ).world_size
    spec = registry.resolve(parallel.strategy, world)  # "auto" is resolved here, once
    runtime = runtime or init_runtime(dist or DistConfig(), always_form_group=spec.needs_group)
    if spec.needs_group and not runtime.distributed:
        raise UserError(f"parallel.strategy = {spec.name!r} needs a process group, but the runtime was made without "
                        "one; pass runtime=None (create_backend forms it) or init_runtime(..., always_form_group=True)")
    policy = get_precision(parallel.precision)
    if parallel.activation_checkpointing:
        apply_activation_checkpointing(model)
    if parallel.compile:
        compile_blocks(model, parallel.compile)
    deferred = has_meta_parameters(model)
    if deferred and not spec.starts_sharded(parallel):
        materialize(model, runtime.device)
        deferred = False
    if deferred:
        model = model.to(dtype=policy.param_dtype)  # still on meta: only the dtype the shards are allocated in
    else:
        model = model.to(runtime.device, dtype=policy.param_dtype)
    stage = (lambda part, ties: materialize(part, runtime.device, aliases=ties)) if deferred else None
    prepared = compose.prepare(spec, model, runtime, parallel, stage)  # pipeline x data x tensor (parallel/mesh.py)
    if deferred and has_meta_parameters(model):  # (a pipeline stage has made its part real already)
        materialize(model, runtime.device, prepared.partition_module)
    scaler = policy.grad_scaler(runtime.device.type, distributed=runtime.distributed)
    optimizer = prepared.build_optimizer(optimizer_factory, grad_clip, scaler)
    scheduler = scheduler_factory(optimizer) if scheduler_factory else None
    return TrainingBackend(prepared, runtime, policy, scheduler, loss_fn, on_nonfinite, max_consecutive_skips,
                           spec.name)
