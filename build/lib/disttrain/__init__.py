"""disttrain: distributed PyTorch training that gives the same numbers on 1..N processes."""

from disttrain._version import __version__
from disttrain.config import Config, ConfigError, ParallelConfig, load_config

__all__ = ["Config", "ConfigError", "ParallelConfig", "load_config", "Trainer", "create_backend", "TrainingBackend",
           "__version__"]


def __getattr__(name):  # lazy: importing disttrain (e.g. for its config) must not import torch
    if name == "Trainer":
        from disttrain.trainer import Trainer

        return Trainer
    if name in ("create_backend", "TrainingBackend"):
        from disttrain import backend

        return getattr(backend, name)
    raise AttributeError(name)
