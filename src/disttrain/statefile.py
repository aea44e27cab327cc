"""Nested training state <-> one safetensors file (the tensors) + one JSON file (everything else).

No pickle anywhere: tensors go through safetensors, structure and scalars through JSON. A nested state
(model, optimizer, scheduler, RNG, counters) is flattened into a JSON skeleton in which each tensor is
replaced by `{"__tensor__": key}`; dicts with non-string keys (optimizer state is keyed by int) and
tuples are tagged so they come back as they were. Tensors that are the same object (tied weights) are
stored once.

Every write returns the file's size and sha256, computed from the bytes written (one pass, no re-read);
`read_verified` checks both before anything is deserialised.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

TENSOR, TUPLE, DICT = "__tensor__", "__tuple__", "__dict__"


class ChecksumError(ValueError):
    """A file does not match what the manifest recorded (size or sha256), or is missing."""


@dataclass(frozen=True)
class FileInfo:
    size: int
    sha256: str


def flatten(obj: Any, tensors: dict[str, torch.Tensor] | None = None, prefix: str = "",
            seen: dict[tuple, str] | None = None) -> tuple[Any, dict[str, torch.Tensor]]:
    """(JSON skeleton, {key: tensor}) for a nested state."""
    tensors = {} if tensors is None else tensors
    seen = {} if seen is None else seen
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype,
                 t.device)
        if ident not in seen:  # tied weights are one tensor: store it once
            key = prefix or "tensor"
            seen[ident] = key
            tensors[key] = t
        return {TENSOR: seen[ident]}, tensors
    if isinstance(obj, np.ndarray):
        return flatten(torch.from_numpy(np.ascontiguousarray(obj)), tensors, prefix, seen)
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: flatten(v, tensors, f"{prefix}.{k}" if prefix else k, seen)[0] for k, v in obj.items()}, tensors
        items = [[k, flatten(v, tensors, f"{prefix}.{k}" if prefix else str(k), seen)[0]] for k, v in obj.items()]
        return {DICT: items}, tensors
    if isinstance(obj, (list, tuple)):
        items = [flatten(v, tensors, f"{prefix}.{i}" if prefix else str(i), seen)[0] for i, v in enumerate(obj)]
        return ({TUPLE: items} if isinstance(obj, tuple) else items), tensors
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj, tensors
    if isinstance(obj, (np.integer, np.floating)):
        return obj.item(), tensors
    raise TypeError(f"cannot store {type(obj).__name__} at '{prefix}' in a checkpoint (tensors, numbers, "
                    "strings, lists, tuples and dicts only)")


def unflatten(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(skeleton, dict):
        if TENSOR in skeleton:
            return tensors[skeleton[TENSOR]]
        if TUPLE in skeleton:
            return tuple(unflatten(v, tensors) for v in skeleton[TUPLE])
        if DICT in skeleton:
            return {k: unflatten(v, tensors) for k, v in skeleton[DICT]}
        return {k: unflatten(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [unflatten(v, tensors) for v in skeleton]
    return skeleton


def write_bytes(path: Path, data: bytes) -> FileInfo:
    """Write and fsync `data`, hashing it in a second thread while it is written (hashlib and file
    writes both release the GIL, so on 2+ cores this costs little more than the write)."""
    digest = hashlib.sha256()
    hasher = threading.Thread(target=digest.update, args=(data,))
    hasher.start()
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    finally:
        hasher.join()
    return FileInfo(len(data), digest.hexdigest())


def write_state(directory: Path, name: str, state: Any) -> dict[str, FileInfo]:
    """Write `<name>.json` (+ `<name>.safetensors` when the state has tensors); return their infos."""
    skeleton, tensors = flatten(state)
    files = {}
    if tensors:
        blob = st_save({k: t.cpu().contiguous() for k, t in tensors.items()})
        files[f"{name}.safetensors"] = write_bytes(directory / f"{name}.safetensors", blob)
    files[f"{name}.json"] = write_bytes(directory / f"{name}.json", json.dumps(skeleton).encode())
    return files


def read_verified(path: Path, expected: FileInfo) -> bytes:
    """The file's bytes, after checking its size and sha256 against `expected`."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ChecksumError(f"{path}: missing") from None
    if len(data) != expected.size:
        raise ChecksumError(f"{path}: size {len(data)} bytes, manifest says {expected.size} (truncated or altered)")
    if hashlib.sha256(data).hexdigest() != expected.sha256:
        raise ChecksumError(f"{path}: sha256 does not match the manifest (altered)")
    return data


def read_state(blobs: dict[str, bytes], name: str) -> Any:
    """Rebuild the state written by `write_state(name)` from already verified bytes."""
    tensors = st_load(blobs[f"{name}.safetensors"]) if f"{name}.safetensors" in blobs else {}
    return unflatten(json.loads(blobs[f"{name}.json"]), tensors)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> FileInfo:
    """Write to a temp file, fsync, rename over `path`, fsync the folder: readers see old or new, never half."""
    tmp = path.with_name(f".{path.name}.tmp")
    info = write_bytes(tmp, data)
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return info
