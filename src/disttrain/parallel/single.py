"""`single`: one process, no wrapper. The reference every other strategy is tested against."""

from __future__ import annotations

import torch

from disttrain.config import ParallelConfig
from disttrain.parallel import Prepared
from disttrain.runtime import Runtime


def apply(model: torch.nn.Module, runtime: Runtime, cfg: ParallelConfig) -> Prepared:
    if runtime.world_size != 1:
        raise ValueError(f"strategy 'single' needs world size 1, got {runtime.world_size}")
    return Prepared(module=model, model=model)
