"""Checkpoints: manager.py (`CheckpointManager`: the save and load protocols, async saves) over catalog.py (the
committed checkpoints of a folder: list, latest, best, rotation), arrival.py (every rank checks in before a collective
save or load), commit.py (manifest + checksums, commit marker, latest), snapshot.py (RNG states, the async save's host
copy), sharded.py (a sharded state's skeleton and DCP shards) and errors.py (`CheckpointError`, `ArrivalError`);
layout.py (the folder layout, verified reads), statefile.py (nested state <-> safetensors + JSON), dcp.py
(torch.distributed.checkpoint with JSON metadata, for sharded states). Nothing read from disk is unpickled except
DCP's shard files, by `torch.load(weights_only=True)`; a file it refuses is a damaged checkpoint."""

from disttrain.checkpoint.layout import (
    COMMIT,
    LATEST,
    MANIFEST,
    is_committed,
    parse_step,
    read_checkpoint_files,
    step_dir_name,
    verify,
)
from disttrain.checkpoint.manager import ArrivalError, CheckpointError, CheckpointManager, restore_rng

__all__ = ["COMMIT", "LATEST", "MANIFEST", "ArrivalError", "CheckpointError", "CheckpointManager", "is_committed",
           "parse_step", "read_checkpoint_files", "restore_rng", "step_dir_name", "verify"]
