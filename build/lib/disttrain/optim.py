"""Optimizer factories and the learning-rate schedule (linear warmup, then cosine to a floor)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from disttrain.config import OptimConfig

OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]


def is_matrix(p: torch.Tensor) -> bool:
    """A weight matrix (decayed): two or more dimensions. A parameter that DeepSpeed ZeRO-3 has partitioned
    before the optimizer is built (the sharded start) is a flat partition; its own shape is in `ds_shape`."""
    return len(getattr(p, "ds_shape", p.shape)) >= 2


def optimizer_factory(cfg: OptimConfig) -> OptimizerFactory:
    """A factory for `optim.name`; weight decay applies to matrices only (not biases, norms)."""

    def build(model: nn.Module) -> torch.optim.Optimizer:
        params = [p for p in model.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if is_matrix(p)], "weight_decay": cfg.weight_decay},
            {"params": [p for p in params if not is_matrix(p)], "weight_decay": 0.0},
        ]
        # both groups, even empty: every pipeline stage (one whose parameters are all frozen, model.freeze, too)
        # and every strategy then has the same groups, which a checkpoint joins and loads group by group
        if cfg.name == "sgd":  # (torch's fused SGD has no sharding rule for FSDP2's DTensors)
            return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.beta1)
        # one kernel per step instead of a few passes over the parameters (the numbers agree to ~1e-7)
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                 fused=_fused_supported(params) or None)

    return build


def align_groups(groups: list[dict], optimizer_state: dict, scheduler_state: dict | None = None,
                 own_scheduler_state: dict | None = None) -> tuple[dict, dict | None]:
    """A saved optimizer (and LR scheduler) state whose parameter groups differ from this optimizer's `groups` only
    by empty ones, fitted to them: the factory keeps empty groups, DeepSpeed drops them (and checkpoints before
    2026-11-27 had none). Saved empty groups this optimizer lacks are left out; where it has an empty group the
    saved state lacks, its own settings (and its scheduler's per-group entries) go in; an optimizer with nothing to
    update (a pipeline stage whose parameters are all frozen) keeps its own groups. Anything else is returned
    unchanged."""
    saved = optimizer_state.get("param_groups")
    if saved is None or len(saved) == len(groups):
        return optimizer_state, scheduler_state
    full = [bool(group["params"]) for group in groups]  # (DeepSpeed ZeRO-3's groups hold none: its partitions)
    order: list[int | None] = []  # for each of ours: the saved group it takes, or None (its own, empty)
    if len(saved) > len(groups):
        order = [i for i, group in enumerate(saved) if group["params"]]
    elif not any(full):
        order = [None] * len(groups)
    elif sum(full) == len(saved):
        rest = iter(range(len(saved)))
        order = [next(rest) if has else None for has in full]
    if len(order) != len(groups):  # (groups made otherwise: the strategy's load maps them, or refuses)
        return optimizer_state, scheduler_state
    fitted = [saved[i] if i is not None else {**{k: v for k, v in group.items() if k != "params"}, "params": []}
              for group, i in zip(groups, order, strict=True)]
    if scheduler_state is not None and own_scheduler_state is not None:
        scheduler_state = _fit_scheduler(scheduler_state, own_scheduler_state, order, len(saved))
    return {**optimizer_state, "param_groups": fitted}, scheduler_state


def _fit_scheduler(state: dict, own: dict, order: list[int | None], saved_groups: int) -> dict:
    """A scheduler's state with its per-group lists (LambdaLR's base_lrs, _last_lr, lr_lambdas; those of the
    schedulers a SequentialLR or ChainedScheduler holds) in `order` (`align_groups`); the rest as saved."""
    out = {}
    for key, value in state.items():
        mine = own.get(key)
        if key == "_schedulers" and isinstance(value, list) and isinstance(mine, list) and len(value) == len(mine):
            out[key] = [_fit_scheduler(s, o, order, saved_groups) for s, o in zip(value, mine, strict=True)]
        elif isinstance(value, list) and len(value) == saved_groups and isinstance(mine, list) \
                and len(mine) == len(order):
            out[key] = [value[i] if i is not None else mine[j] for j, i in enumerate(order)]
        else:
            out[key] = value
    return out


def _fused_supported(params: list[torch.Tensor]) -> bool:
    """torch's fused optimizer kernels exist for floating-point parameters on CPU and CUDA."""
    return bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)


def lr_lambda(warmup_steps: int, total_steps: int, min_ratio: float, shape: str = "cosine"
              ) -> Callable[[int], float]:
    """Multiplier of the peak LR for optimizer step `s` (0-based): (s+1)/warmup, then cosine to min_ratio (or,
    for `shape="constant"`, 1)."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if shape == "constant":
            return 1.0
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def schedule_name(cfg: OptimConfig, user_optimizer: bool = False) -> str:
    """`optim.schedule` with `auto` resolved: cosine for disttrain's own optimizer, none for yours (your
    optimizer's learning rate is used as it is unless you ask for a schedule)."""
    if cfg.schedule != "auto":
        return cfg.schedule
    return "none" if user_optimizer else "cosine"


def scheduler_factory(cfg: OptimConfig, total_steps: int, user_optimizer: bool = False):
    """`factory(optimizer) -> LambdaLR` for `optim.schedule`, or None when the schedule is `none`."""
    shape = schedule_name(cfg, user_optimizer)
    if shape == "none":
        return None
    factor = lr_lambda(cfg.warmup_steps, total_steps, cfg.min_lr_ratio, shape)
    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
