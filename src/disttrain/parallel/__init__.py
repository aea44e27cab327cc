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
}


@dataclass
class Prepared:
    """A model made ready for one strategy.

    module:   what forward/backward run on (e.g. the DDP wrapper).
    model:    the plain user model underneath (state dicts, optimizer parameter groups, evaluation).
    no_sync:  context manager for accumulation micro-batches whose gradients must not be reduced yet.
    make_optimizer: builds the optimizer from the user's factory (strategies that shard optimizer
              state wrap it here).
    """

    module: torch.nn.Module
    model: torch.nn.Module
    no_sync: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    make_optimizer: Callable[[Callable[[Any], Any]], Any] | None = None
    grads_averaged_over: int = 1
    """Ranks whose gradients the strategy averages (DDP: world size); the backend turns the mean back
    into a sum before dividing by the global item count."""
    info: dict[str, Any] = field(default_factory=dict)

    def build_optimizer(self, factory: Callable[[Any], Any]):
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
