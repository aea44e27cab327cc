"""Typed configuration: nested dataclasses, TOML loading, dotted overrides and pure validation.

Every field carries a docstring (the string literal under it); `describe()` (describe.py) reads them back, so
the README table and `--help` never drift from the code. Each component receives only its own section.
The sections live in `sections.py`, reading and writing a configuration in `loading.py`, the checks that run
before any process starts in `validation.py`; this module is the one place to import them from.
"""

from __future__ import annotations

from disttrain.config.describe import describe
from disttrain.config.loading import (
    GPU_BOUND_ENV,
    NODE_CLAIM_ENV,
    dumps_toml,
    from_env,
    load_config,
    save_config,
    set_value,
    to_env,
)
from disttrain.config.sections import (
    CHOICES,
    CheckpointConfig,
    Config,
    DataConfig,
    DistConfig,
    LogConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
)
from disttrain.config.validation import (
    profile_range,
    ray_resources,
    strategies_for,
    uses_cuda,
    validate,
    validate_model,
)
from disttrain.errors import ConfigError

__all__ = ["CHOICES", "GPU_BOUND_ENV", "NODE_CLAIM_ENV", "CheckpointConfig", "Config", "ConfigError", "DataConfig",
           "DistConfig", "LogConfig", "ModelConfig", "OptimConfig", "ParallelConfig", "RunConfig", "TrainConfig",
           "describe", "dumps_toml", "from_env", "load_config", "profile_range", "ray_resources", "save_config",
           "set_value", "strategies_for", "to_env", "uses_cuda", "validate", "validate_model"]
