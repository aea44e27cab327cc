"""Precision policies, one object per name: the autocast context, parameter and reduction dtypes, and
whether the loss is scaled.

    fp32        everything in float32
    bf16-mixed  float32 parameters and optimizer; forward under bfloat16 autocast; under FSDP parameters
                are gathered in bfloat16 and gradients reduced in float32 (MixedPrecisionPolicy)
    fp16-mixed  as bf16-mixed with float16, plus dynamic loss scaling (torch's GradScaler; the sharded
                scaler under FSDP) so small gradients do not underflow
    bf16-true   parameters, optimizer state and floating inputs in bfloat16 (half the memory, no fp32 master)

Listing the names does not import torch (config validation uses them before any process starts).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from disttrain.errors import ConfigError

PRECISIONS: tuple[str, ...] = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-true")


PRECISION_MEANINGS: dict[str, str] = {
    "fp32": "float32 weights and compute",
    "bf16-mixed": "float32 weights, forward under bfloat16 autocast",
    "fp16-mixed": "float32 weights, forward under float16 autocast with dynamic loss scaling",
    "bf16-true": "bfloat16 weights, optimizer state and compute",
}
"""What each canonical precision means (a test keeps the keys equal to PRECISIONS)."""

PRECISION_ALIASES: dict[str, str] = {
    "bf16": "bf16-mixed", "16": "fp16-mixed", "16-mixed": "fp16-mixed", "fp16": "fp16-mixed",
    "32": "fp32", "32-true": "fp32", "no": "fp32",
}
"""Lightning Fabric's and Accelerate's spellings, accepted at the user's boundary (config files, --set)."""


def canonical_precision(value: str) -> str:
    """The canonical name of a precision spelling; ConfigError saying what each option means otherwise."""
    name = value.strip().lower()
    name = PRECISION_ALIASES.get(name, name)
    if name in PRECISION_MEANINGS:
        return name
    options = "; ".join(f"'{k}' = {v}" for k, v in PRECISION_MEANINGS.items())
    hint = " (float16 weights have no mode here)" if "16" in name and "true" in name else ""
    raise ConfigError(f"parallel.precision = {value!r} is not known{hint}; choose by meaning: {options}")


@dataclass(frozen=True)
class Precision:
    name: str
    compute_dtype: Any = None
    """autocast dtype of the forward pass (None: no autocast)."""
    param_dtype: Any = None
    """dtype parameters are stored in (None: float32)."""
    loss_scaling: bool = False
    """Dynamic loss scaling (fp16)."""

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager:
        """Context for forward passes (and the loss)."""
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        import torch

        return torch.autocast(device_type, dtype=self.compute_dtype)

    def fsdp_policy(self):
        """FSDP2 MixedPrecisionPolicy: gather parameters in the compute dtype, reduce gradients in float32."""
        if self.compute_dtype is None:
            return None
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)

    def grad_scaler(self, device_type: str, distributed: bool):
        """torch's GradScaler in one process; with a process group FSDP's ShardedGradScaler (a GradScaler
        for sharded and replicated gradients alike), which all-reduces the inf/NaN finding so that every
        rank skips the same steps, even when only one rank's gradients (or shard) overflowed."""
        if not self.loss_scaling:
            return None
        import torch

        if distributed:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            return ShardedGradScaler(device=device_type)
        return torch.amp.GradScaler(device_type)


def update_scale(scaler, found_inf: bool) -> None:
    """GradScaler's dynamic rule (back off on inf/NaN, grow after `growth_interval` clean steps) for a step
    whose inf/NaN check was made elsewhere: by an engine (DeepSpeed) that holds the gradients itself and agrees
    the finding across ranks. Goes through the scaler's state dict, so its checkpoint stays the usual one."""
    state = scaler.state_dict()
    scale = state["scale"] * (state["backoff_factor"] if found_inf else 1.0)
    tracker = 0 if found_inf else state["_growth_tracker"] + 1
    if tracker >= state["growth_interval"]:
        scale, tracker = scale * state["growth_factor"], 0
    scaler.load_state_dict({**state, "scale": scale, "_growth_tracker": tracker})


def get_precision(name: str) -> Precision:
    import torch

    policies = {
        "fp32": Precision("fp32"),
        "bf16-mixed": Precision("bf16-mixed", compute_dtype=torch.bfloat16),
        "fp16-mixed": Precision("fp16-mixed", compute_dtype=torch.float16, loss_scaling=True),
        "bf16-true": Precision("bf16-true", param_dtype=torch.bfloat16),
    }
    if name not in policies:
        raise ConfigError(f"parallel.precision = {name!r} is not known; valid names: {', '.join(PRECISIONS)}")
    return policies[name]
