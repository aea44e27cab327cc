"""Parallel strategies: a registry of `StrategySpec`s, one module per strategy (single, ddp, zero, fsdp,
deepspeed/). Each spec owns its `apply(model, runtime, parallel_cfg) -> Prepared`, its option checks, its memory
layout and its capability flags; nothing outside this package names a strategy. See spec.py and registry.py.
"""

from disttrain.parallel.registry import register, resolve
from disttrain.parallel.spec import Prepared, StrategySpec

__all__ = ["Prepared", "StrategySpec", "register", "resolve"]
