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
from typing import Protocol

import torch
from torch import nn

from disttrain.errors import ConfigError
from disttrain.parallel.state import parameter_names, tie_groups


class WeightsSource(Protocol):
    def load_into(self, model: nn.Module, aliases: list[list[str]] = ()) -> None:
        """Fill every parameter (full tensors, or this rank's shards of DTensors) and persistent buffer; `aliases`:
        groups of names of one tied weight in the unpruned model (a pipeline stage may hold it under a name the
        files do not have)."""

    def load_tensor(self, model: nn.Module, name: str, tensor: torch.Tensor) -> None:
        """Fill one full parameter, `name` as in `model.named_parameters()`."""


_LOADERS: weakref.WeakKeyDictionary[nn.Module, WeightsSource] = weakref.WeakKeyDictionary()


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


def defer(model: nn.Module, source: WeightsSource) -> nn.Module:
    """Mark `model` (parameters on meta) as filled from `source` when `materialize` runs."""
    _LOADERS[model] = source
    return model


def has_meta_parameters(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def _set_parameter(model: nn.Module, name: str, param: nn.Parameter) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(owner) if owner else model, leaf, param)


def _source(model: nn.Module) -> WeightsSource:
    source = _LOADERS.pop(model, None)
    if source is None:
        raise ConfigError("the model's parameters are on the meta device and disttrain has no weights for them; "
                          "build it on a real device, or load it with model.name = 'hf:DIR'")
    return source


def materialize(model: nn.Module, device: torch.device,
                after_module: Callable[[nn.Module], None] | None = None, aliases: list[list[str]] = ()) -> None:
    """Allocate the meta parameters on `device` (each rank's shards, if a strategy has sharded them), keep the
    real buffers and the ties between shared parameters, and fill the parameters from the registered source.

    With `after_module`, parameters are made real module by module, children first, and `after_module(module)` runs
    once each module's own parameters are filled (e.g. DeepSpeed ZeRO-3 partitions them there): the peak is one
    full tensor, not the model."""
    source = _source(model)
    if after_module is not None:
        _materialize_by_module(model, device, source, after_module)
        return
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
        source.load_into(model, aliases)


def _materialize_by_module(model: nn.Module, device: torch.device, source: WeightsSource,
                           after_module: Callable[[nn.Module], None]) -> None:
    names = parameter_names(model)
    for module in _children_first(model):
        for param in list(module.parameters(recurse=False)):
            if not param.is_meta:
                continue  # filled already (a tied parameter seen in another module)
            group = names[id(param)]
            real = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device),
                                requires_grad=param.requires_grad)
            for name in group:
                _set_parameter(model, name, real)
            with torch.no_grad():
                source.load_tensor(model, group[0], real)
        after_module(module)


def _children_first(module: nn.Module) -> Iterator[nn.Module]:
    for child in module.children():
        yield from _children_first(child)
    yield module
