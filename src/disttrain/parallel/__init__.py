"""Parallel strategies: each is a function `apply(model, runtime, cfg) -> Prepared`, registered by name.

The registry maps names to import paths, so listing the names (config validation) never imports torch,
and adding a strategy is one new module plus one line here. The core never asks which strategy it has:
everything strategy-specific lives in the `Prepared` object the function returns.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

STRATEGIES: dict[str, str] = {
    "single": "disttrain.parallel.single:apply",
    "ddp": "disttrain.parallel.ddp:apply",
    "zero1": "disttrain.parallel.zero:apply",
    "zero2": "disttrain.parallel.fsdp:apply_zero2",
    "fsdp": "disttrain.parallel.fsdp:apply_fsdp",
    "zero3": "disttrain.parallel.fsdp:apply_fsdp",  # the documented alias of fsdp
    "hsdp": "disttrain.parallel.fsdp:apply_hsdp",
    "deepspeed": "disttrain.parallel.deepspeed_engine:apply",  # optional extra: pip install 'disttrain[deepspeed]'
}


@dataclass
class Engine:
    """For a strategy whose engine owns backward, gradient reduction, clipping and the optimizer step
    (DeepSpeed): the backend calls these instead of doing that work itself.

    build(factory, grad_clip) -> optimizer: wraps the user's optimizer in the engine (the returned optimizer
              is what the LR schedule drives).
    backward(loss_sum, sync): back-propagates one micro-batch; `sync` marks the last of the step.
    step(factor) -> (global gradient norm, applied): multiplies the reduced gradients by `factor` (the
              backend's normalisation, the same as for every strategy), clips, and steps unless the gradients
              are non-finite.
    """

    build: Callable[[Callable[[Any], Any], float], Any]
    backward: Callable[[torch.Tensor, bool], None]
    step: Callable[[float], tuple[float, bool]]


@dataclass
class Prepared:
    """A model made ready for one strategy.

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
    """Ranks whose gradients the strategy averages (DDP: world size); the backend turns the mean back
    into a sum before dividing by the global item count."""
    info: dict[str, Any] = field(default_factory=dict)
    state_dict: Callable[[Any], tuple[dict, dict]] | None = None
    load_state_dict: Callable[[Any, dict, dict], None] | None = None
    checkpoint_target: Callable[[str, Any, Any], Any] | None = None
    """For sharded checkpoints: the tensor a saved tensor (key, global size, dtype) is loaded into
    (None: a full tensor on every rank)."""
    engine: Engine | None = None
    """Set by engine strategies (deepspeed); None for the torch-native ones."""

    def __post_init__(self):
        if self.state_dict is None:
            fns = full_state_dict_fns(self.model)
            self.state_dict, self.load_state_dict = fns["state_dict"], fns["load_state_dict"]

    def build_optimizer(self, factory: Callable[[Any], Any], grad_clip: float = 0.0):
        if self.engine is not None:
            return self.engine.build(factory, grad_clip)
        return self.make_optimizer(factory) if self.make_optimizer else factory(self.model)


def get_strategy(name: str) -> Callable[..., Prepared]:
    if name not in STRATEGIES:
        from disttrain.config import ConfigError, _suggest

        raise ConfigError(f"parallel.strategy = {name!r} is not known; {_suggest(name, list(STRATEGIES))}")
    module_name, _, func = STRATEGIES[name].partition(":")
    return getattr(importlib.import_module(module_name), func)


def resolve(name: str, world_size: int) -> str:
    """`auto` is `single` on one process and `ddp` on several; other names are returned unchanged."""
    if name != "auto":
        return name
    return "single" if world_size == 1 else "ddp"


def full_state_dict_fns(model, sharded: bool = False) -> dict[str, Callable]:
    """state_dict/load_state_dict through torch.distributed.checkpoint.state_dict, keyed by parameter
    names for a plain module, DDP and FSDP2 alike. `sharded`: each rank's own shards (DTensors, saved
    through DCP); otherwise full tensors on every rank. Loading accepts either form."""

    def state_dict(optimizer):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=not sharded))

    def load_state_dict(optimizer, model_state: dict, optimizer_state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        full = not any(hasattr(t, "to_local") for t in model_state.values())
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state,
                       options=StateDictOptions(full_state_dict=full))

    return {"state_dict": state_dict, "load_state_dict": load_state_dict}

