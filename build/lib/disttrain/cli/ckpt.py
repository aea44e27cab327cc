"""`disttrain ckpt list | verify | export`: look into checkpoint folders without training."""

from __future__ import annotations

import json
from pathlib import Path

from disttrain.checkpoint import MANIFEST, CheckpointManager, is_committed, parse_step
from disttrain.checkpoint import verify as verify_folder
from disttrain.checkpoint.export import DEFAULT_MAX_SHARD_SIZE, export_hf, export_safetensors
from disttrain.checkpoint.statefile import ChecksumError
from disttrain.config import CheckpointConfig, ConfigError, load_config


def _checkpoints_dir(path: Path) -> Path:
    if (path / "checkpoints").is_dir():
        return path / "checkpoints"
    if path.is_dir():
        return path
    raise ConfigError(f"'{path}' is not a run folder or a checkpoints folder; pass RUN_DIR")


def _step_dirs(directory: Path) -> list[Path]:
    return sorted((p for p in directory.iterdir() if p.is_dir() and parse_step(p) is not None), key=parse_step)


def _manager(directory: Path) -> CheckpointManager:
    """A manager configured like the run that wrote the checkpoints (for best_metric / best_mode)."""
    config = directory.parent / "config.toml"
    cfg = load_config(config).checkpoint if config.is_file() else CheckpointConfig()
    return CheckpointManager(directory, cfg)


DAMAGED = (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError)
"""What reading a damaged manifest raises (missing, not JSON, wrong keys or types)."""


def list(path: Path) -> int:  # noqa: A001 - named after the subcommand
    directory = _checkpoints_dir(path)
    manager = _manager(directory)
    latest, best = manager.latest(), manager.best()
    print(f"{'step':>8}  {'state':<11} {'saved':<25} {'world':>5}  {'size MiB':>8}  metrics")
    for step_dir in _step_dirs(directory):
        step = parse_step(step_dir)
        if not is_committed(step_dir):
            print(f"{step:>8}  {'uncommitted':<11}")
            continue
        try:
            print(_row(step_dir, step, marks="".join([" (latest)" if step == latest else "",
                                                       " (best)" if step == best else ""])))
        except DAMAGED as exc:
            print(f"{step:>8}  {'damaged':<11} {MANIFEST}: {type(exc).__name__}: {exc} (`disttrain ckpt verify`)")
    return 0


def _row(step_dir: Path, step: int, marks: str) -> str:
    """A committed checkpoint's line of `ckpt list`, from its manifest (raises one of DAMAGED if that is damaged)."""
    manifest = json.loads((step_dir / MANIFEST).read_text())
    size = sum(f["size"] for f in manifest["files"].values()) / 2**20
    metrics = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in manifest.get("metrics", {}).items() if k in ("loss", "eval_loss"))
    return (f"{step:>8}  {'committed':<11} {manifest['time']:<25} {manifest['world_size']:>5}  {size:>8.2f}  "
            f"{metrics}{marks}")


def verify(path: Path) -> int:
    if not path.is_dir():
        raise ConfigError(f"'{path}' " + ("is not a folder" if path.exists() else "does not exist")
                          + "; pass a run folder, its checkpoints folder or one step_N folder")
    folders = [path] if parse_step(path) is not None else _step_dirs(_checkpoints_dir(path))
    if not folders:
        print(f"no checkpoints in {path}")
        return 1
    bad = 0
    for folder in folders:
        if not is_committed(folder):
            print(f"{folder.name}: uncommitted (an interrupted save; ignored by resume)")
            bad += parse_step(path) is not None
            continue
        try:
            manifest = verify_folder(folder)
            print(f"{folder.name}: ok ({len(manifest['files'])} files verified by sha256)")
        except (ChecksumError, *DAMAGED) as exc:
            print(f"{folder.name}: BAD: {exc}")
            bad += 1
    return 1 if bad else 0


def export(path: Path, out: Path, *, format: str = "safetensors", max_shard_size: str = DEFAULT_MAX_SHARD_SIZE,
           dtype: str = "fp32", force: bool = False) -> int:
    """Model weights of one checkpoint, read and written one tensor at a time (checkpoint/export.py): one
    safetensors file (every name, tied weights included) or, with `format="hf"`, a Hugging Face folder."""
    if format == "hf":
        files = export_hf(path, out, max_shard_size=max_shard_size, dtype=dtype, force=force)
        print(f"wrote {out} ({', '.join(files)}) from {path}")
    else:
        count = export_safetensors(path, out, dtype=dtype, force=force)
        print(f"wrote {count} tensors from {path} to {out}")
    return 0
