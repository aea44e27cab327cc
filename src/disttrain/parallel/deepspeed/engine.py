"""`deepspeed`: DeepSpeed's engine running ZeRO stage 0-3 (optional extra: `pip install 'disttrain[deepspeed]'`).

The engine owns backward, gradient reduction, clipping and the optimizer step, so this strategy's `Prepared`
overrides `backward` and `step` (see parallel/spec.py) and the backend keeps everything else (counting, the step's one
all-reduce, non-finite policy, schedule, metrics). How the numbers stay equal to every other strategy:

- The optimizer is the user's torch optimizer (DeepSpeed's "client optimizer"): the same update as
  plain AdamW, and no native op to compile (DeepSpeed's cpu_adam/fused_adam take ~70 s each the first time).
- The backend marks accumulation boundaries itself (`set_gradient_accumulation_boundary`) and back-propagates
  the summed loss unscaled (`scale_wrt_gas=False`); DeepSpeed averages the reduced gradients over ranks.
- Normalisation by the global item count, known only after the last micro-batch, goes through the ZeRO
  optimizer's loss scale: DeepSpeed divides the partitioned gradients by it (and computes the true norm, clips
  and skips a non-finite step) inside `step()`. Stage 0 has no ZeRO optimizer: the gradients are in
  `param.grad` and are scaled there, as for DDP.
- Clipping is DeepSpeed's `gradient_clipping` (= optim.grad_clip): under ZeRO the gradients exist only as
  partitions inside the engine, so the backend could not clip them without gathering them.

Checkpoints: the same full, name-keyed state as every other strategy (gathered with DeepSpeed's public
`safe_get_full_*` / `GatheredParameters` APIs), so a deepspeed checkpoint resumes under ddp or fsdp and back.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import warnings

import torch
from torch import nn

from disttrain.parallel import comm
from disttrain.parallel.deepspeed.config import DeepSpeedConfig
from disttrain.parallel.deepspeed.timed import deepspeed_comms
from disttrain.parallel.spec import Prepared, unfused
from disttrain.precision import update_scale


def apply(model: nn.Module, runtime, cfg) -> Prepared:
    os.environ.setdefault("DS_ACCELERATOR", runtime.device.type)  # read once, when deepspeed is imported
    # DeepSpeed's engine and zero.Init take their GPU from LOCAL_RANK (asserting it is set): the rank's device here,
    # which a Slurm launch does not export and a launcher binding one GPU per rank makes cuda:0 for every rank
    os.environ["LOCAL_RANK"] = str(runtime.device.index if runtime.device.type == "cuda" else runtime.local_rank)
    import deepspeed

    if runtime.device.type == "cpu":
        # DeepSpeed's comm backend compiles its shm_comm op when it starts (~50 s on a machine's first run).
        # Only inference_all_reduce uses it, and training never calls that: skip the build.
        compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
        if isinstance(compatible, dict):
            compatible["deepspeed_shm_comm"] = False

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # it logs its whole config and every scale change
    # DeepSpeed calls the collectives torch 2.13 renamed (all_gather_single, reduce_scatter_single) by their old
    # names, which still work: without this each rank prints the rename notice at every ZeRO call site
    warnings.filterwarnings("ignore", message=r".*`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` "
                            "is deprecated", category=FutureWarning)
    prepared = EnginePrepared(module=model, model=model, grads_averaged_over=runtime.world_size, cfg=cfg,
                              world=runtime.world_size, ds=deepspeed, comm=comm.meter_for(runtime.device))
    if cfg.deepspeed_stage == 3 and any(p.is_meta for p in model.parameters()):
        # a sharded start: each module is partitioned as soon as its parameters are real (one full tensor at a
        # time), with the engine's own ZeRO-3 settings; the engine then finds the parameters partitioned already
        numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        full = DeepSpeedConfig.from_parallel(cfg, runtime.world_size, 0.0, model_numel=numel).to_dict()
        # what partitioning reads (ZeRO-3 settings, precision); the batch keys are checked against a world size
        # that deepspeed.comm does not know before the engine starts
        config = {k: v for k, v in full.items() if k in ("zero_optimization", "fp16", "bf16")}
        config["train_micro_batch_size_per_gpu"] = 1
        prepared.partition_module = lambda module: deepspeed.zero.Init(module=module, config_dict_or_path=config)
    return prepared


class EnginePrepared(Prepared):
    """The engine owns backward, reduction, clipping and the step; the plain model's names, shapes and the
    user's groups are kept for the name-keyed state dict."""

    def __init__(self, *, cfg, world: int, ds, **kwargs):
        super().__init__(**kwargs)
        self.cfg, self.world, self.ds = cfg, world, ds
        self.stage = cfg.deepspeed_stage
        self.params = dict(self.model.named_parameters())  # each tensor once (tied weights: the first name)
        self.shapes = {name: tuple(p.shape) for name, p in self.params.items()}
        self.group_names: list[list[str]] = []
        self.engine = None
        self.state_dict, self.load_state_dict = self._state_dict, self._load_state_dict

    def build_optimizer(self, factory, grad_clip: float = 0.0, scaler=None):
        self.grad_clip, self.scaler = grad_clip, scaler
        self.params = dict(self.model.named_parameters())  # a sharded start replaced the meta parameters
        optimizer = unfused(factory)(self.model)  # torch's fused kernels refuse the engine's tensors
        names = {p: n for n, p in self.params.items()}
        # (DeepSpeed drops the empty groups from the optimizer: the backend fits a saved state's to it)
        self.group_names = [[names[p] for p in group["params"]] for group in optimizer.param_groups if group["params"]]
        numel = sum(p.numel() for p in self.params.values() if p.requires_grad)
        config = DeepSpeedConfig.from_parallel(self.cfg, self.world, grad_clip, model_numel=numel).to_dict()
        self.engine, _, _, _ = self.ds.initialize(model=self.model, optimizer=optimizer, config=config,
                                                  dist_init_required=False)
        if self.comm is not None:  # every collective of the engine goes through deepspeed.comm's backend object
            deepspeed_comms(importlib.import_module("deepspeed.comm.comm").cdb, self.comm)
        self.optimizer = optimizer  # the user's; under ZeRO its groups now hold this rank's flat partitions
        self.module = self.engine
        return optimizer

    def steps_on_device(self, device) -> bool:
        return False  # the engine's own step decides and reads back (its optimizer is never fused)

    def backward(self, loss: torch.Tensor, sync: bool) -> None:
        self.engine.set_gradient_accumulation_boundary(sync)
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self, factor: float, skip: bool = False, need_norm: bool = True) -> tuple[float, bool]:
        """The engine normalises (by `factor`, with fp16's loss scale undone), clips and steps, and itself skips a
        step whose gradients are non-finite on any rank. One gap: it has no way to refuse a step whose gradients
        are finite, so `skip` (a non-finite loss with train.on_nonfinite = 'skip') is honoured at stage 0 only;
        at stages 1-3 the backend counts that step as skipped although the engine applied it."""
        scale = self.scaler.get_scale() if self.scaler is not None else 1.0
        norm, applied = self._engine_step(factor / scale, skip and self.stage == 0)
        if self.scaler is not None:
            update_scale(self.scaler, found_inf=not applied)
        return norm, applied

    def drop_gradients(self, optimizer) -> None:
        """As a refused stage-0 step clears them. One gap: at stages 1-3 the engine keeps the reduced partitions
        until its own step, so the next step adds to them; a global batch with no item gives zero gradients under
        disttrain's losses (a sum over no item), so nothing is added, but a loss that counts no item and returns a
        non-zero sum would leak into the next update."""
        self.engine.zero_grad()

    def _engine_step(self, factor: float, skip: bool) -> tuple[float, bool]:
        if self.stage == 0:
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            torch._foreach_mul_(grads, factor)
            norm = torch.nn.utils.get_total_norm(grads).item()
            if skip or not math.isfinite(norm):
                self.engine.zero_grad()
                return norm, False
            self.engine.step()  # clips (gradient_clipping) and steps the user's optimizer
            return norm, True
        zero = self.engine.optimizer
        zero.override_loss_scale(1.0 / factor)  # step() divides the reduced partitions by it
        try:
            self.engine.step()
        finally:
            zero.override_loss_scale(1.0)  # the next step's backward multiplies the loss by it
        return float(self.engine.get_global_grad_norm()), self.engine.was_step_applied()

    # ---- checkpoints: full, name-keyed, strategy-independent (collectives: every rank calls these)

    def _state_dict(self, optimizer) -> tuple[dict, dict]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        with self.ds.zero.GatheredParameters(list(self.model.parameters())):  # stage 3: full tensors; else no-op
            model_state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        if self.stage == 0:  # the user's optimizer on the model's own parameters
            return model_state, get_optimizer_state_dict(self.model, optimizer,
                                                         options=StateDictOptions(full_state_dict=True))
        from deepspeed.utils import safe_get_full_optimizer_state

        flat_states = [s for s in optimizer.state.values() if s]
        if not flat_states:
            return model_state, {"state": {}, "param_groups": self._param_groups(optimizer)}
        self._link_optimizer_state()
        keys = [k for k, v in flat_states[0].items() if torch.is_tensor(v) and v.dim() > 0]
        scalars = {k: v.clone() for k, v in flat_states[0].items() if k not in keys}  # e.g. AdamW's step
        state = {name: {**{k: v.clone() for k, v in scalars.items()},
                        **{k: safe_get_full_optimizer_state(p, k).reshape(self.shapes[name]).clone() for k in keys}}
                 for name, p in self.params.items() if p.requires_grad}
        return model_state, {"state": state, "param_groups": self._param_groups(optimizer)}

    def _param_groups(self, optimizer) -> list[dict]:
        return [{**{k: v for k, v in group.items() if k != "params"}, "params": list(names)}
                for group, names in zip(optimizer.param_groups, self.group_names, strict=True)]

    def _load_state_dict(self, optimizer, model_state: dict, optimizer_state: dict) -> None:
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in model_state.items()}
        with self.ds.zero.GatheredParameters(list(self.model.parameters()), modifier_rank=0):
            self.model.load_state_dict(full)
        if self.stage == 0:
            set_optimizer_state_dict(self.model, optimizer, optimizer_state,
                                     options=StateDictOptions(full_state_dict=True))
            return
        for name, p in self.params.items():  # the engine's fp32 master partitions
            if p.requires_grad:
                safe_set_full_fp32_param(p, full[name])
        for group, saved in zip(optimizer.param_groups, optimizer_state["param_groups"], strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        saved_state = optimizer_state["state"]
        if not saved_state:
            return
        self._create_optimizer_state(optimizer, next(iter(saved_state.values())))
        for name, p in self.params.items():
            for key, value in saved_state.get(name, {}).items():
                if torch.is_tensor(value) and value.dim() > 0:
                    safe_set_full_optimizer_state(p, value.full_tensor() if hasattr(value, "full_tensor") else value,
                                                  key)

    def _create_optimizer_state(self, optimizer, example: dict) -> None:
        """torch optimizers create their state at the first step; a resumed engine needs it before (zeros of
        each flat partition's shape, scalars such as AdamW's step from the checkpoint) to copy the saved
        values into."""
        zero = self.engine.optimizer  # this rank's flat fp32 partitions, the tensors the user's optimizer steps
        flats = zero.single_partition_of_fp32_groups if self.stage < 3 else zero.fp32_partitioned_groups_flat
        for flat in flats:
            optimizer.state[flat] = {k: (torch.zeros_like(flat) if torch.is_tensor(v) and v.dim() > 0 else
                                         (v.clone() if torch.is_tensor(v) else v))
                                     for k, v in example.items()}
        self._link_optimizer_state()

    def _link_optimizer_state(self) -> None:
        """ZeRO-1/2 give each parameter a view of its fragment of the flat optimizer state, made once, after
        the first parameter group's first step: the other groups' state does not exist yet then, so their
        views stay empty (DeepSpeed 0.19.8), and a resumed engine has none at all. Make them again now."""
        if self.stage not in (1, 2):
            return  # stage 3 looks the state up on every access
        from deepspeed.utils.mixed_precision_linkage import lazy_init_hp_params_optimizer_state

        zero = self.engine.optimizer
        for params, flat in zip(zero.bit16_groups, zero.single_partition_of_fp32_groups, strict=True):
            lazy_init_hp_params_optimizer_state(params, flat, zero.optimizer.state)
