"""Sharded tensors through torch.distributed.checkpoint (DCP), with its metadata as JSON instead of pickle.

DCP writes each rank's shards to `__<rank>_<n>.distcp` files (tensors in torch.save format, read back with
`torch.load(weights_only=True)`) and a `.metadata` file that its FileSystemReader loads with `pickle.load`.
Our rule is no unpickling from disk, so `JsonMetadataWriter` writes the same metadata as `metadata.json`
(and removes the pickle), and `JsonMetadataReader` rebuilds DCP's Metadata from that JSON. Only tensors
go through DCP (non-tensor values live in the JSON state skeleton), so nothing is stored as pickled bytes.
Resharding is DCP's: a checkpoint saved on N ranks loads on M ranks, sharded or into full tensors.

A shard file that `torch.load(weights_only=True)` refuses (a planted pickle whose checksums were forged to
match) is a damaged checkpoint: `load_sharded` raises `ChecksumError` naming the file, on every rank, so the
manager falls back to the previous checkpoint as it does for any other bad file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from disttrain.checkpoint.layout import DCP_METADATA
from disttrain.checkpoint.statefile import ChecksumError


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def metadata_to_json(metadata: Metadata) -> dict[str, Any]:
    tensors = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            raise TypeError(f"'{fqn}' is not a tensor; only tensors are stored through DCP")
        tensors[fqn] = {"dtype": _dtype_name(md.properties.dtype), "size": list(md.size),
                        "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks]}
    storage = [{"fqn": index.fqn, "offset": list(index.offset) if index.offset is not None else None,
                "index": index.index, "path": info.relative_path, "file_offset": info.offset,
                "length": info.length, "transforms": list(info.transform_descriptors or [])}
               for index, info in metadata.storage_data.items()]
    return {"version": metadata.version, "tensors": tensors, "storage": storage}


def metadata_from_json(data: dict[str, Any]) -> Metadata:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    state = {fqn: TensorStorageMetadata(
        properties=TensorProperties(dtype=getattr(torch, md["dtype"])), size=torch.Size(md["size"]),
        chunks=[ChunkStorageMetadata(offsets=torch.Size(c["offsets"]), sizes=torch.Size(c["sizes"]))
                for c in md["chunks"]]) for fqn, md in data["tensors"].items()}
    storage = {MetadataIndex(s["fqn"], s["offset"], s["index"]):
               _StorageInfo(s["path"], s["file_offset"], s["length"], s["transforms"] or None)
               for s in data["storage"]}
    return Metadata(state_dict_metadata=state, storage_data=storage, version=data["version"])


class JsonMetadataWriter(FileSystemWriter):
    def finish(self, metadata: Metadata, results) -> None:
        super().finish(metadata, results)  # writes the pickled .metadata (removed below)
        # where each item landed, from the write results themselves (torch's own finish fills
        # metadata.storage_data in place in some releases and on a copy in others)
        storage = {result.index: result.storage_data for per_rank in results for result in per_rank}
        data = json.dumps(metadata_to_json(dataclasses.replace(metadata, storage_data=storage))).encode()
        path = Path(self.path)
        tmp = path / f".{DCP_METADATA}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path / DCP_METADATA)
        (path / ".metadata").unlink()


class JsonMetadataReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = metadata_from_json(json.loads((Path(self.path) / DCP_METADATA).read_text()))
        metadata.storage_meta = StorageMeta(load_id=self.load_id)
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """DCP's read, one shard file at a time, so that a file the loader refuses can be named."""
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in per_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except pickle.UnpicklingError as exc:  # how torch.load(weights_only=True) refuses what is not tensors
                raise ChecksumError(f"{Path(self.path) / name}: refused by torch.load(weights_only=True), "
                                    f"not plain tensor data ({_refusal_reason(exc)})") from None
        done: Future[None] = Future()
        done.set_result(None)
        return done


def _refusal_reason(exc: pickle.UnpicklingError) -> str:
    """The one line of torch's long weights_only message that says what was refused."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    useful = [line for line in lines[1:] if not line.startswith(("Check the documentation", "Please file an issue"))]
    return (useful or lines or ["unreadable"])[-1]


def save_sharded(tensors: dict[str, torch.Tensor], path: Path, group=None) -> list[str]:
    """All ranks: write `tensors` (plain or DTensor) into `path`; return the files this rank wrote. `group`:
    the process group of DCP's own collectives (default: the default group)."""
    before = set(os.listdir(path))
    dcp.save(tensors, storage_writer=JsonMetadataWriter(path), no_dist=not torch.distributed.is_initialized(),
             process_group=group)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    written = [name for name in set(os.listdir(path)) - before if name.startswith(f"__{rank}_")]
    return sorted(written + ([DCP_METADATA] if rank == 0 else []))


def tensor_metadata(path: Path) -> dict[str, dict[str, Any]]:
    """Global size and dtype of every tensor in a DCP folder (from the JSON metadata)."""
    return json.loads((path / DCP_METADATA).read_text())["tensors"]


def load_sharded(targets: dict[str, torch.Tensor], path: Path) -> None:
    """All ranks: fill `targets` (plain tensors get the whole tensor, DTensors their shard) in place. A shard
    file refused on any rank raises `ChecksumError` naming it, on every rank."""
    try:
        with warnings.catch_warnings():  # without a process group DCP warns that it assumes one process: we mean it
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(targets, storage_reader=JsonMetadataReader(path),
                     no_dist=not torch.distributed.is_initialized())
    except CheckpointException as exc:
        # DCP gathers every rank's failure and raises this on every rank, so the ranks agree. It is a
        # BaseException: a refused file is re-raised as what the manager's fallback handles.
        refused = sorted({str(error) for error, _ in exc.failures.values() if isinstance(error, ChecksumError)})
        if not refused:
            raise
        raise ChecksumError("; ".join(refused)) from None
