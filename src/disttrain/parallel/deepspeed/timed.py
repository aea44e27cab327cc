"""DeepSpeed's collectives, timed: every collective of a DeepSpeed engine goes through `deepspeed.comm`'s backend
object (its `TorchBackend`); that object's collective methods are replaced by timed calls of the class's own, through
the strategies' `CommMeter` (parallel/comm.py). This counts the engine's small all-reduces too (gradient norm, overflow
flag), which are part of its step.
"""

from __future__ import annotations

import functools
from typing import Any

from disttrain.parallel.comm import CommMeter, nbytes_of, timed_call

DEEPSPEED_COLLECTIVES = {
    "all_reduce": (0, "tensor"), "all_reduce_coalesced": (0, "tensors"), "reduce": (0, "tensor"),
    "broadcast": (0, "tensor"), "reduce_scatter": (1, "input_list"), "reduce_scatter_tensor": (1, "input_tensor"),
    "all_gather": (0, "tensor_list"), "all_gather_into_tensor": (0, "output_tensor"),
    "all_gather_base": (0, "output_tensor"), "all_gather_coalesced": (0, "output_tensors"),
    "all_to_all_single": (1, "input"), "all_to_all": (1, "input_tensor_list"),
}
"""The collective methods of DeepSpeed's `TorchBackend` and the argument whose size is counted (nccl-tests' sizes:
an all-gather's output, a reduce-scatter's input, the buffer otherwise), by position and name: the class's
decorators hide its signatures from `inspect`."""


def deepspeed_comms(backend: Any, meter: CommMeter) -> None:
    """Time each collective of `backend` (`deepspeed.comm`'s `cdb`, shared by every engine of the process) with
    `meter`: the class's method, timed, is set on that object. A later engine's call replaces the earlier wrappers
    (they wrap the class's methods, never each other)."""
    for name, counted in DEEPSPEED_COLLECTIVES.items():
        method = getattr(type(backend), name, None)
        if method is not None:
            setattr(backend, name, _deepspeed_timed(method.__get__(backend), counted, meter))


def _deepspeed_timed(method, counted: tuple[int, str], meter: CommMeter):
    position, name = counted

    @functools.wraps(method)
    def timed(*args, **kwargs):
        tensors = args[position] if len(args) > position else kwargs[name]
        nbytes = sum(map(nbytes_of, tensors)) if isinstance(tensors, list | tuple) else nbytes_of(tensors)
        return timed_call(meter, functools.partial(method, *args, **kwargs), nbytes)

    return timed
