"""How a batch reaches the model: the calling convention every strategy shares, and the device move.

A dict batch calls the model with the keys its `forward` names, as keyword arguments (`input_ids`,
`attention_mask`, `position_ids`, ...). `labels` stay with the loss: disttrain computes the token-summed loss from
the outputs itself (a model's own mean loss would weight micro-batches and ranks wrongly), so they are not
passed. Keys the forward does not name stay in the batch for a loss function (e.g. an RL loss's `advantages`).
A dict batch that names none of the forward's parameters calls it with its `input_ids` (or `inputs`) positionally;
a tuple or list batch with its first item; a tensor with itself.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from disttrain.errors import ConfigError
from disttrain.models.hf import is_hf_model

LABEL_KEYS = frozenset({"labels"})


def to_device(batch: Any, device: torch.device, float_dtype: torch.dtype | None = None) -> Any:
    """Move tensors to `device`; floating tensors also to `float_dtype` when given (bf16-true)."""
    if isinstance(batch, torch.Tensor):
        dtype = float_dtype if float_dtype is not None and batch.is_floating_point() else None
        return batch.to(device, dtype=dtype, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device, float_dtype) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device, float_dtype) for v in batch)
    return batch


def batch_size(batch: Any) -> int:
    """Samples in a batch: the length of its first tensor (`input_ids` first for a dict)."""
    if isinstance(batch, dict):
        first = batch.get("input_ids", batch.get("inputs", next(iter(batch.values()), None)))
        return len(first)
    if isinstance(batch, (list, tuple)):
        return len(batch[0])
    return len(batch)


@dataclass
class Inputs:
    """Positional and keyword arguments of one model call."""

    args: tuple = ()
    kwargs: dict[str, Any] | None = None

    def __call__(self, module: nn.Module) -> Any:
        return module(*self.args, **(self.kwargs or {}))


class ModelCall:
    """Turns batches into the arguments of `model.forward` (see the module docstring); built once per model."""

    def __init__(self, model: nn.Module):
        params = inspect.signature(model.forward).parameters.values()
        named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        self.model_name = type(model).__name__
        self.names = [p.name for p in named]
        self.required = [p.name for p in named if p.default is p.empty]
        # an HF model in training: no key/value cache (it is memory, and useless without generation)
        self.defaults = {"use_cache": False} if is_hf_model(model) and "use_cache" in self.names else {}

    def __call__(self, batch: Any) -> Inputs:
        if isinstance(batch, dict):
            return self._from_dict(batch)
        if isinstance(batch, (list, tuple)):
            return Inputs((batch[0],))
        return Inputs((batch,))

    def _from_dict(self, batch: dict[str, Any]) -> Inputs:
        kwargs = {k: v for k, v in batch.items() if k in self.names and k not in LABEL_KEYS}
        if not kwargs:
            first = batch.get("input_ids", batch.get("inputs"))
            if first is None:
                raise ConfigError(f"data: a batch with keys {sorted(batch)} names none of "
                                  f"{self.model_name}.forward's arguments ({', '.join(self.names)}) and has no "
                                  "'input_ids' or 'inputs'; rename the keys in your dataset or collate_fn")
            return Inputs((first,))
        missing = [name for name in self.required if name not in kwargs]
        if missing:
            raise ConfigError(f"data: {self.model_name}.forward needs {', '.join(missing)}, which the batch "
                              f"(keys {sorted(batch)}) does not have; add them in your dataset or collate_fn")
        return Inputs(kwargs={**self.defaults, **kwargs})
