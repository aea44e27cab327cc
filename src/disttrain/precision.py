"""Precision policies, one object per name: the autocast context and the dtypes a strategy uses.

Only `fp32` exists so far; mixed precision (bf16/fp16 with loss scaling) plugs in here as more
entries without the backend changing.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Precision:
    name: str
    param_dtype: str = "float32"
    """dtype the parameters are stored in."""

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager:
        """Context for forward passes (and the loss)."""
        return contextlib.nullcontext()


PRECISIONS: dict[str, Precision] = {
    "fp32": Precision("fp32"),
}


def get_precision(name: str) -> Precision:
    if name not in PRECISIONS:
        from disttrain.config import ConfigError

        raise ConfigError(f"parallel.precision = {name!r} is not known; valid names: {', '.join(PRECISIONS)}")
    return PRECISIONS[name]
