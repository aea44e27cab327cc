"""A sharded state's files: its skeleton (the nested structure and every non-tensor value, JSON) written by rank 0,
its tensors written and read through torch.distributed.checkpoint (dcp.py, imported only where a state is sharded)
by every rank; and the skeleton of a state whose ranks hold different parts (pipeline stages)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from disttrain.checkpoint.commit import describe_os_error
from disttrain.checkpoint.errors import CheckpointError
from disttrain.checkpoint.statefile import DICT, TENSOR, FileInfo, flatten, hash_file, unflatten, write_bytes


def is_sharded(state: Any) -> bool:
    return any(hasattr(t, "to_local") for t in flatten(state)[1].values())


def write_skeleton(path: Path, state: Any, skeleton=None) -> dict[str, FileInfo]:
    """Rank 0, DCP layout: the state's skeleton as `state.json` (`skeleton`: every rank's, merged)."""
    skeleton = flatten(state)[0] if skeleton is None else skeleton
    return {"state.json": write_bytes(path / "state.json", json.dumps({"skeleton": skeleton}).encode())}


def write_dcp(path: Path, state: Any, group, files: dict[str, FileInfo]) -> CheckpointError | None:
    """Every rank: the state's tensors as DCP shards with JSON metadata, their infos added to `files`; the error, if
    the write failed (DCP gathers every rank's outcome and raises on all of them alike)."""
    from torch.distributed.checkpoint.api import CheckpointException

    from disttrain.checkpoint.dcp import save_sharded  # DCP and DTensor only where a state is sharded

    try:
        for name in save_sharded(flatten(state)[1], path, group or None):
            files[name] = hash_file(path / name)
    except OSError as exc:
        return CheckpointError(describe_os_error(exc, path))
    except CheckpointException as exc:  # (a BaseException)
        problems = sorted({str(e).splitlines()[0] if str(e) else type(e).__name__ for e, _ in exc.failures.values()})
        return CheckpointError(f"cannot write checkpoint {path}: {'; '.join(problems)}; earlier checkpoints are "
                               "untouched")
    return None


def read_sharded(path: Path, skeleton: Any, target) -> Any:
    """The state, each tensor read into `target(key, size, dtype)`; a target of None leaves that tensor unread (None
    in the state: a pipeline stage reads only its own parameters)."""
    from disttrain.checkpoint.dcp import load_sharded, tensor_metadata  # DCP and DTensor only where a state is sharded

    meta = tensor_metadata(path)
    make = target or (lambda key, size, dtype: torch.empty(size, dtype=dtype))
    targets = {key: make(key, torch.Size(m["size"]), getattr(torch, m["dtype"])) for key, m in meta.items()}
    wanted = {key: t for key, t in targets.items() if t is not None}
    load_sharded(wanted, path)
    return unflatten(skeleton, {**targets, **wanted})


def merge_skeletons(skeletons: list[Any]) -> Any:
    """One skeleton holding every rank's keys, for states whose ranks hold different parts (pipeline stages: their
    own parameters and optimizer state; parameter-name lists, such as an optimizer group's, are joined)."""
    def merge(a, b):
        if isinstance(a, dict) and isinstance(b, dict) and TENSOR not in a and TENSOR not in b:
            if DICT in a and DICT in b:
                return {DICT: [list(kv) for kv in merge(dict(map(tuple, a[DICT])), dict(map(tuple, b[DICT]))).items()]}
            return {**b, **{k: merge(v, b[k]) if k in b else v for k, v in a.items()}}
        if isinstance(a, list) and isinstance(b, list):
            if all(isinstance(x, str) for x in a + b):
                return a + [x for x in b if x not in a]
            if len(a) == len(b):
                return [merge(x, y) for x, y in zip(a, b, strict=True)]
        return a

    out = skeletons[0]
    for other in skeletons[1:]:
        out = merge(out, other)
    return out
