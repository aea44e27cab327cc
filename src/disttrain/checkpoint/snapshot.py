"""What a save takes from the running job: this rank's RNG states (and, on resume, their restore), and a host copy of
the state that training cannot modify while a background thread writes it (`Staging`: async saves)."""

from __future__ import annotations

from typing import Any

import torch

from disttrain.checkpoint.statefile import flatten, unflatten


def rng_state() -> dict[str, Any]:
    import random

    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():  # this rank's GPU (the current device): the others are other ranks', and a resume
        state["cuda"] = torch.cuda.get_rng_state()  # may see another number of GPUs (one per task under Slurm)
    return state


def restore_rng(state: dict[str, Any]) -> None:
    import random

    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    # Loaded tensors are views into the checkpoint's buffer; torch's RNG setters need tensors of their own
    # (torch 2.13 segfaults on a view with a storage offset).
    torch.set_rng_state(state["torch"].clone())
    if "cuda" in state and torch.cuda.is_available():
        saved = state["cuda"]
        if isinstance(saved, (list, tuple)):  # saved before 2026-11-26: every visible GPU's; this rank's GPU's
            here = torch.cuda.current_device()
            saved = saved[here] if here < len(saved) else None
        if saved is not None:
            torch.cuda.set_rng_state(saved.clone())


class Staging:
    """Host buffers an async save copies the state into, kept from one save to the next (only one is in flight)."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    @torch.no_grad()  # also in the background thread, where grad mode is on by default
    def copy(self, state: Any) -> Any:
        """A copy that training cannot modify while the background thread writes it. The copies go into
        buffers kept from the previous save (only one save is in flight), so after the first save a
        snapshot costs one memcpy instead of fresh allocations and their page faults."""
        skeleton, tensors = flatten(state)
        staged = {}
        for key, t in tensors.items():
            local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: copy this rank's shard
            buf = self.buffers.get(key)
            if buf is None or buf.shape != local.shape or buf.dtype != local.dtype:
                buf = self.buffers[key] = torch.empty(local.shape, dtype=local.dtype, device="cpu")
            buf.copy_(local)
            if hasattr(t, "to_local"):  # the same shard of the same global tensor, now in host memory
                from torch.distributed.tensor import DTensor

                # the host copy under the same spec (a host tensor on a GPU mesh, as FSDP2's CPU offload holds its
                # shards): `from_local` would move it back to the mesh's device type, onto a GPU
                staged[key] = DTensor(buf, t._spec, requires_grad=False)
            else:
                staged[key] = buf
        for key in self.buffers.keys() - tensors.keys():
            del self.buffers[key]
        return unflatten(skeleton, staged)
