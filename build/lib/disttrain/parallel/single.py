"""`single`: one process, no wrapper. The reference every other strategy is tested against."""

from __future__ import annotations

from disttrain.parallel import layout
from disttrain.parallel.spec import Prepared, StrategySpec


def apply(model, runtime, cfg) -> Prepared:
    return Prepared(module=model, model=model)


SPECS = (StrategySpec("single", apply, "one process, no wrapper (the reference)", layout.replicated,
                      needs_group=False, max_world=1),)
