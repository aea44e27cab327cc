"""One checkpoint's folder: rank 0's commit (every rank's file list into the manifest, then the commit marker, then
`latest`: manager.py has the protocol) and removal (uncommitted first); and what every rank uses to report a failed
write (`describe_os_error`, its one line; `try_write`, a rank's error for rank 0 to read)."""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from disttrain._version import __version__
from disttrain.checkpoint.errors import CheckpointError
from disttrain.checkpoint.layout import COMMIT, LATEST, MANIFEST, step_dir_name
from disttrain.checkpoint.statefile import atomic_write, fsync_dir, write_bytes

log = logging.getLogger(__name__)


def commit(directory: Path, step: int, path: Path, world_size: int, info: dict[str, Any], metrics: dict[str, Any],
           timeout: float | None, layout: str) -> None:
    """Rank 0: gather every rank's file list, write the manifest, then the commit marker, then `latest` (of
    `directory`, the checkpoints' folder; `path` is this checkpoint's); `info` is recorded in the manifest."""
    files: dict[str, Any] = {}
    deadline = time.monotonic() + (timeout or 0)
    for rank in range(world_size):
        listing = path / f"files_rank{rank}.json"
        while not listing.is_file():  # async saves: other ranks write in their own time
            if timeout is None or time.monotonic() > deadline:
                raise CheckpointError(f"checkpoint {path} not committed: rank {rank} never finished writing")
            time.sleep(0.05)
        listed = json.loads(listing.read_text())
        if "__error__" in listed:
            raise CheckpointError(f"rank {rank}: {listed['__error__']}")
        files.update(listed)
    for rank in range(world_size):
        (path / f"files_rank{rank}.json").unlink()
    manifest = {"format": 1, "layout": layout, "step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "world_size": world_size, **info, "torch": torch.__version__,
                "disttrain": __version__, "metrics": finite_or_str(metrics), "files": files}
    manifest_info = write_bytes(path / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    write_bytes(path / COMMIT, manifest_info.sha256.encode())
    fsync_dir(path)
    atomic_write(directory / LATEST, step_dir_name(step).encode())
    log.info("checkpoint step %d committed (%s)", step, path)


def remove_checkpoint(path: Path) -> None:
    """Uncommit first, so that a deletion interrupted half-way leaves a folder discovery ignores."""
    (path / COMMIT).unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)


def describe_os_error(exc: OSError, path: Path) -> str:
    try:
        free = shutil.disk_usage(path.parent).free
        space = f"{free / 2**20:.1f} MiB free on that file system"
    except OSError:
        space = "free space unknown"
    return f"cannot write checkpoint {exc.filename or path}: {exc.strerror or exc} ({space}); earlier checkpoints " \
           "are untouched"


def try_write(path: Path, data: bytes) -> None:
    try:
        atomic_write(path, data)
    except OSError:
        pass  # the disk is what failed; rank 0 will time out and say so


def finite_or_str(metrics: dict[str, Any]) -> dict[str, Any]:
    return {k: (v if not isinstance(v, float) or math.isfinite(v) else str(v)) for k, v in metrics.items()}
