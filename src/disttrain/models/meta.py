"""Models that start without their weights, so that no rank ever holds the full model.

A loader builds the model with its parameters on the meta device (no memory) and its buffers computed for real
(rotary caches and the like are not in a weights file), and registers how to fill the parameters (`defer`).
`create_backend` applies the strategy first, so a sharding strategy turns each meta parameter into a meta
shard, then `materialize` allocates this rank's shards and the loader reads exactly those rows from the weights
file. A strategy that does not shard gets the model materialised in full before it is applied.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator

import torch
from torch import nn

from disttrain.errors import ConfigError

WeightsLoader = Callable[[nn.Module], None]
"""load(model): fill every parameter (full tensors, or this rank's shards of DTensors) without autograd."""

_LOADERS: weakref.WeakKeyDictionary[nn.Module, WeightsLoader] = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Build modules whose parameters land on the meta device while buffers stay real.

    Each parameter is created for real by its module's constructor and replaced by a meta tensor as it is
    registered, so the peak is one tensor, not the model. (`torch.device("meta")` would put the buffers on meta
    too, and a rotary cache cannot be read back from a weights file.)"""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def defer(model: nn.Module, load: WeightsLoader) -> nn.Module:
    """Mark `model` (parameters on meta) as filled by `load` when `materialize` runs."""
    _LOADERS[model] = load
    return model


def has_meta_parameters(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def tie_groups(model: nn.Module) -> list[list[str]]:
    """Names of each parameter shared by several modules (tied embeddings), first name first."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def _set_parameter(model: nn.Module, name: str, param: nn.Parameter) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(owner) if owner else model, leaf, param)


def materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate the meta parameters on `device` (each rank's shards, if a strategy has sharded them), keep the
    real buffers and the ties between shared parameters, and fill the parameters with the registered loader."""
    load = _LOADERS.pop(model, None)
    if load is None:
        raise ConfigError("the model's parameters are on the meta device and disttrain has no weights for them; "
                          "build it on a real device, or load it with model.name = 'hf:DIR'")
    ties = tie_groups(model)
    buffers = {name: b for name, b in model.named_buffers() if not b.is_meta}
    model.to_empty(device=device)
    for group in ties:  # to_empty gives each module its own new tensor: share the first one again
        first = model.get_parameter(group[0])
        for name in group[1:]:
            _set_parameter(model, name, first)
    for name, buffer in buffers.items():
        owner, _, leaf = name.rpartition(".")
        (model.get_submodule(owner) if owner else model)._buffers[leaf] = buffer.to(device)
    with torch.no_grad():
        load(model)
