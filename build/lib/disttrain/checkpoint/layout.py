"""The on-disk layout of a checkpoint folder, and reading one back verified.

Layout (`<directory>` is usually `RUN_DIR/checkpoints`):

    step_<N>/
        state.safetensors, state.json      full state (model, optimizer, scheduler, counters, config), rank 0
                                           (a large state: state-0000i-of-0000n.safetensors, written and
                                           hashed in parallel; statefile.PART_BYTES)
        __<R>_<n>.distcp, metadata.json    a sharded state instead (DCP, every rank its shards; dcp.py)
        rank<R>.safetensors, rank<R>.json  per-rank state (RNG), every rank
        files_rank<R>.json                 size + sha256 of the files rank R wrote (read by rank 0)
        manifest.json                      step, time, world size, strategy, config hash, versions, metrics,
                                           and size + sha256 of every file above
        COMMITTED                          sha256 of manifest.json; written last, by rank 0
    latest                                 name of the newest committed checkpoint (a hint; replaced atomically)

"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from disttrain.checkpoint.statefile import ChecksumError, FileInfo, read_verified

COMMIT, MANIFEST, LATEST = "COMMITTED", "manifest.json", "latest"
DCP_METADATA = "metadata.json"
"""A sharded checkpoint's DCP metadata, in JSON (dcp.py)."""


def step_dir_name(step: int) -> str:
    return f"step_{step}"


def parse_step(path: Path) -> int | None:
    name = path.name
    if name.startswith("step_") and name[5:].isdigit():
        return int(name[5:])
    return None


def is_committed(path: Path) -> bool:
    return (path / COMMIT).is_file()


def verify(path: Path) -> dict[str, Any]:
    """Check a checkpoint folder (commit marker, manifest, every file); return the manifest or raise
    ChecksumError naming the first bad file."""
    return read_checkpoint_files(path)[0]


def read_checkpoint_files(path: Path, reads=None, share: tuple[int, int] = (0, 1), shared=None
                          ) -> tuple[dict[str, Any], dict[str, bytes]]:
    """(manifest, {file name: verified bytes}): files read once and checked against the manifest.

    By default every file is checked and returned. Ranks that check a checkpoint together give `reads` (the file
    names this rank deserialises: checked and returned) and `share` = (their index, their count): of the `shared`
    files (default: all it does not read; the manager's: DCP's shard files, which no rank reads whole) each is
    hashed by one of them only, so that they are hashed once over the job, not once per rank; the ranks agree on
    the outcome afterwards (manager.py). The manager leaves other ranks' states to those ranks (the files of ranks
    a smaller world lacks are read by no one)."""
    if not is_committed(path):
        raise ChecksumError(f"{path}: not committed (no {COMMIT} marker; the save did not finish)")
    if not (path / MANIFEST).is_file():
        raise ChecksumError(f"{path / MANIFEST}: missing")
    manifest_bytes = (path / MANIFEST).read_bytes()
    if hashlib.sha256(manifest_bytes).hexdigest() != (path / COMMIT).read_text().strip():
        raise ChecksumError(f"{path / MANIFEST}: does not match the commit marker (altered)")
    manifest = json.loads(manifest_bytes)
    files = manifest["files"]
    names = sorted(files)
    kept = [name for name in names if reads is None or reads(name)]
    others = [name for name in names if reads is not None and not reads(name) and (shared is None or shared(name))]
    index, count = share
    checked = kept + others[index::count]
    # hashlib releases the GIL: large files are verified in parallel (write_state splits large states)
    with ThreadPoolExecutor(max(1, min(len(checked), os.cpu_count() or 1))) as pool:
        verified = list(pool.map(lambda name: read_verified(path / name, FileInfo(**files[name])), checked))
    return manifest, dict(zip(kept, verified[:len(kept)], strict=True))
