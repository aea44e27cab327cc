"""What a weight sync sends and how it is named: the endpoint scheme, the element types it casts to, its error, and
the pieces of the model one rank sends (`local_pieces`: its shards, or a whole tensor chosen by name among the ranks
that hold it)."""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch

SCHEME = "dtws://"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class WeightSyncError(RuntimeError):
    """A weight sync that did not reach every consumer: which consumer, and why."""


def parse_dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    if name not in DTYPES:
        raise ValueError(f"dtype = {name!r}: choose one of {', '.join(DTYPES)} (or None: the model's own)")
    return DTYPES[name]


@dataclass
class Piece:
    """One rank's part of a tensor of the model: `local` is the slice at `offset` of a tensor of `shape`."""

    name: str
    shape: list[int]
    offset: list[int]
    local: torch.Tensor | None
    alias: str | None = None  # a tied weight: the name sent for it (sent once, named twice)


def _chosen(name: str, size: int) -> int:
    """Which of `size` ranks holding the same bytes sends them (spread by name, the same on every rank)."""
    return zlib.crc32(name.encode()) % size


def local_pieces(model: torch.nn.Module, layout, rank: int) -> list[Piece]:
    """The parts of `model`'s state (parameters and persistent buffers, by their names in the user's model) that
    this rank sends. Collective for DTensors whose shards are not contiguous blocks (FSDP over tensor parallel):
    every rank must call it, in the same order."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mine = layout.coords(rank)
    stage = [r for r in range(layout.world) if layout.coords(r)["pp"] == mine["pp"]]  # ranks holding this stage
    pieces, first_name = [], {}
    for name, tensor in get_model_state_dict(model).items():
        if not isinstance(tensor, torch.Tensor):
            continue
        held = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        same = (held.untyped_storage().data_ptr(), held.storage_offset(), tuple(held.shape), tuple(tensor.shape))
        if held.numel() and same in first_name:  # tied to an earlier name: sent once, both names point at it
            pieces.append(Piece(name, list(tensor.shape), [], None, alias=first_name[same]))
            continue
        first_name[same] = name
        if isinstance(tensor, DTensor):
            mesh, placements = tensor.device_mesh, tensor.placements
            coordinate = mesh.get_coordinate()
            if all(type(p) in (Shard, Replicate) for p in placements):  # plain blocks: send my own shard
                local = tensor.to_local()
                shape, offset = compute_local_shape_and_global_offset(tensor.shape, mesh, placements)
                if tuple(local.shape) == tuple(shape):
                    replicas = [d for d, p in enumerate(placements) if isinstance(p, Replicate)]
                    if all(coordinate[d] == _chosen(name, mesh.size(d)) for d in replicas) and local.numel():
                        pieces.append(Piece(name, list(tensor.shape), list(offset), local))
                    continue
            full = tensor.full_tensor()  # strided or partial shards: one tensor at a time, never the model
            flat = [c for c in coordinate]
            index = sum(c * math.prod(mesh.shape[d + 1:]) for d, c in enumerate(flat))
            if index == _chosen(name, mesh.size()):
                pieces.append(Piece(name, list(full.shape), [0] * full.dim(), full))
        elif stage.index(rank) == _chosen(name, len(stage)):
            pieces.append(Piece(name, list(tensor.shape), [0] * tensor.dim(), tensor))
    return pieces


def endpoint(addresses: list[str], token: str) -> str:
    """The string a consumer needs: every rank's address and the sync's token."""
    return f"{SCHEME}{','.join(addresses)}#{token}"
