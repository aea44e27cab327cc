"""The on-disk layout of a checkpoint folder, and reading one back verified.

Layout (`<directory>` is usually `RUN_DIR/checkpoints`):

    step_<N>/
        state.safetensors, state.json      full state (model, optimizer, scheduler, counters, config), rank 0
                                           (a large state: state-0000i-of-0000n.safetensors, written and
                                           hashed in parallel; statefile.PART_BYTES)
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


def read_checkpoint_files(path: Path) -> tuple[dict[str, Any], dict[str, bytes]]:
    """(manifest, {file name: verified bytes}): every file read once and checked against the manifest."""
    if not is_committed(path):
        raise ChecksumError(f"{path}: not committed (no {COMMIT} marker; the save did not finish)")
    if not (path / MANIFEST).is_file():
        raise ChecksumError(f"{path / MANIFEST}: missing")
    manifest_bytes = (path / MANIFEST).read_bytes()
    if hashlib.sha256(manifest_bytes).hexdigest() != (path / COMMIT).read_text().strip():
        raise ChecksumError(f"{path / MANIFEST}: does not match the commit marker (altered)")
    manifest = json.loads(manifest_bytes)
    files = manifest["files"]
    # hashlib releases the GIL: large files are verified in parallel (write_state splits large states)
    with ThreadPoolExecutor(max(1, min(len(files), os.cpu_count() or 1))) as pool:
        verified = pool.map(lambda item: read_verified(path / item[0], FileInfo(**item[1])), files.items())
        blobs = dict(zip(files, verified, strict=True))
    return manifest, blobs
