"""A checkpoint's model weights for inference: one flat safetensors file, or a Hugging Face model folder.

    export_safetensors(step_dir, out)      every weight name -> OUT.safetensors (tied names stored once per name)
    export_hf(step_dir, out)               config.json + model.safetensors (or model-0000i-of-0000n.safetensors
                                           and model.safetensors.index.json above `max_shard_size`) +
                                           generation_config.json when the source model had one

Memory: the weights are read one tensor at a time and streamed into the output, so an export needs about one
tensor's worth of memory whatever the model's size. A DCP (sharded) checkpoint is read with one `dcp.load` of a
one-key state dict per tensor, in this process and without a process group (DCP reads that tensor's chunks
from every rank's shard file and nothing else); a full checkpoint's tensors are views of its verified,
memory-mapped files. Each safetensors file's header is written first (the shapes and dtypes are known from the
checkpoint's metadata), then each tensor's bytes as it is read; nothing holds more than the tensor in hand.

Where the Hugging Face config comes from: `state["hf_config"]`, which `TrainingBackend.state_dict()` stores for a
transformers `PreTrainedModel`; failing that, `DIR/config.json` of a run whose `model.name` is `"hf:DIR"`.
Tied weights (`lm_head.weight` = `model.embed_tokens.weight` under `tie_word_embeddings`) are one tensor in the
checkpoint; as `save_pretrained` does, the folder stores it once, under the first name of the model's state
dict order (the embedding), so `from_pretrained` reports no missing or unexpected keys.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from disttrain.checkpoint.dcp import load_sharded, tensor_metadata
from disttrain.checkpoint.layout import parse_step, read_checkpoint_files
from disttrain.checkpoint.manager import CheckpointError
from disttrain.checkpoint.statefile import SAFETENSORS_DTYPES, TENSOR, ChecksumError, load_safetensors, unflatten
from disttrain.errors import ConfigError, make_folder

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""`--dtype` names -> the dtype floating-point weights are written in (integer tensors keep theirs)."""
HF_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
DEFAULT_MAX_SHARD_SIZE = "5GB"
"""The Hub's long-standing shard size (transformers 5's `save_pretrained` defaults to 50GB)."""
WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """Bytes of `"5GB"` (10^9, as Hugging Face counts), `"200MiB"` (2^20) or `"1000"`."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match and match.group(2).upper()
    if not match or unit not in _SIZE_UNITS or float(match.group(1)) * _SIZE_UNITS[unit] < 1:
        raise ConfigError(f"--max-shard-size {text!r} is not a size; give bytes or a number with KB/MB/GB "
                          "(powers of 1000) or KiB/MiB/GiB, e.g. --max-shard-size 5GB")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


@dataclass
class CheckpointWeights:
    """The model weights of one committed checkpoint, readable one at a time. `names` maps each weight name
    (the model's state dict order) to the key it is stored under; tied names share a key."""

    path: Path
    names: dict[str, str]
    shapes: dict[str, tuple[torch.Size, torch.dtype]]
    read: Callable[[str], torch.Tensor]
    skeleton: dict[str, Any]
    """The state's JSON skeleton: every non-tensor value (step, config, hf_config) as saved."""

    def value(self, key: str) -> Any:
        return unflatten(self.skeleton.get(key), {})


def open_checkpoint(path: Path) -> CheckpointWeights:
    """Verify a `step_<N>` folder (commit marker, every file's sha256) and index its model weights."""
    if parse_step(path) is None or not path.is_dir():
        raise ConfigError(f"'{path}' is not a step_<N> checkpoint folder; see `disttrain ckpt list RUN_DIR`")
    try:
        manifest, blobs = read_checkpoint_files(path)
    except (ChecksumError, OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"cannot export {path}: {exc}; see `disttrain ckpt verify`") from None
    if manifest.get("layout", "full") == "full":
        skeleton = json.loads(blobs["state.json"].numpy().tobytes())
        stored: dict[str, torch.Tensor] = {}
        for name, blob in blobs.items():  # views of the memory-mapped files: nothing is copied here
            if re.fullmatch(r"state(-\d{5}-of-\d{5})?\.safetensors", name):
                stored.update(load_safetensors(blob))
        shapes = {key: (t.shape, t.dtype) for key, t in stored.items()}
        read = stored.__getitem__
    else:
        skeleton = json.loads(blobs["state.json"].numpy().tobytes())["skeleton"]
        del blobs  # verified; the tensors are read from the files through DCP, one at a time
        shapes = {key: (torch.Size(m["size"]), getattr(torch, m["dtype"])) for key, m in tensor_metadata(path).items()}

        def read(key: str) -> torch.Tensor:
            size, dtype = shapes[key]
            target = {key: torch.empty(size, dtype=dtype)}
            load_sharded(target, path)
            return target[key]

    if not isinstance(skeleton.get("model"), dict):
        raise ConfigError(f"{path} holds no model weights (no 'model' in its state); it was not saved by the Trainer "
                          "or TrainingBackend.state_dict()")
    names = {name: ref[TENSOR] for name, ref in skeleton["model"].items()}
    return CheckpointWeights(path, names, {k: shapes[k] for k in set(names.values())}, read, skeleton)


def _out_dtype(dtype: torch.dtype, target: torch.dtype) -> torch.dtype:
    return target if dtype.is_floating_point else dtype


@dataclass
class _Entry:
    name: str
    key: str
    shape: torch.Size
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize


def write_streamed(path: Path, entries: list[_Entry], read: Callable[[str], torch.Tensor],
                   metadata: dict[str, str]) -> None:
    """A safetensors file whose header is written from the entries' shapes, then each tensor's bytes as it is
    read (largest element size first, so that every tensor stays aligned for a zero-copy load)."""
    entries = sorted(entries, key=lambda e: -e.dtype.itemsize)
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for e in entries:
        header[e.name] = {"dtype": SAFETENSORS_DTYPES[e.dtype], "shape": list(e.shape),
                          "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for e in entries:
            tensor = read(e.key).to(e.dtype).contiguous()
            if tensor.shape != e.shape:
                raise ValueError(f"{e.name}: read {tuple(tensor.shape)}, the checkpoint says {tuple(e.shape)}")
            if e.nbytes:
                f.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
            del tensor  # only the tensor in hand is ever held
        f.flush()
        os.fsync(f.fileno())


def _entries(weights: CheckpointWeights, dtype: torch.dtype, dedupe: bool) -> list[_Entry]:
    """One entry per weight name, or per stored tensor (`dedupe`: tied names after the first are left out)."""
    seen, out = set(), []
    for name, key in weights.names.items():
        if dedupe and key in seen:
            continue
        seen.add(key)
        shape, stored = weights.shapes[key]
        out.append(_Entry(name, key, shape, _out_dtype(stored, dtype)))
    return out


def split_shards(entries: list[_Entry], max_bytes: int) -> list[list[_Entry]]:
    """Hugging Face's rule: fill shards in order; a tensor that would overflow the current one starts the next;
    a tensor larger than `max_bytes` gets a shard of its own."""
    shards: list[list[_Entry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and (size + e.nbytes > max_bytes):
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


# -- the two formats --------------------------------------------------------------------------------


def export_safetensors(path: Path, out: Path, *, dtype: str = "fp32", force: bool = False) -> int:
    """Every weight name of the checkpoint into one safetensors file (tied names each hold a copy, so a strict
    `load_state_dict` of the file works). Returns the number of tensors written."""
    target = _dtype(dtype)
    weights = open_checkpoint(path)
    _refuse_existing(out, force, is_file=True)
    entries = _entries(weights, target, dedupe=False)
    make_folder(out.parent, "OUT's folder")
    tmp = out.with_name(f".{out.name}.partial")
    try:
        write_streamed(tmp, entries, weights.read, {"format": "pt", "step": str(weights.value("step")),
                                                    "source": str(path)})
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return len(entries)


def export_hf(path: Path, out: Path, *, max_shard_size: str = DEFAULT_MAX_SHARD_SIZE, dtype: str = "fp32",
              force: bool = False) -> list[str]:
    """A folder `transformers.AutoModelForCausalLM.from_pretrained(out)` loads. Returns the files written."""
    target, max_bytes = _dtype(dtype), parse_size(max_shard_size)
    weights = open_checkpoint(path)
    config, source_dir = hf_config(weights)
    _refuse_existing(out, force, is_file=False)
    config["dtype"] = HF_DTYPE_NAMES[target]
    if "torch_dtype" in config:  # written by transformers 4: keep the two in agreement
        config["torch_dtype"] = HF_DTYPE_NAMES[target]
    shards = split_shards(_entries(weights, target, dedupe=True), max_bytes)
    names = [WEIGHTS] if len(shards) == 1 else [f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                                                 for i in range(1, len(shards) + 1)]
    staging = make_folder(out.parent, "OUT's folder") / f".{out.name}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        for name, shard in zip(names, shards, strict=True):
            write_streamed(staging / name, shard, weights.read, {"format": "pt"})
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(e.nbytes for s in shards for e in s)},
                     "weight_map": {e.name: name for name, s in zip(names, shards, strict=True) for e in s}}
            (staging / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        generation = source_dir / "generation_config.json" if source_dir else None
        if generation is not None and generation.is_file():
            shutil.copyfile(generation, staging / "generation_config.json")
        written = sorted(p.name for p in staging.iterdir())
        _move_into(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return written


def hf_config(weights: CheckpointWeights) -> tuple[dict[str, Any], Path | None]:
    """(the model's Hugging Face config, the model folder it came from if known). ConfigError if the checkpoint
    is not of a Hugging Face model."""
    name = str((weights.value("config") or {}).get("model", {}).get("name", ""))
    source_dir = Path(name[3:]) if name.startswith("hf:") else None
    config = weights.value("hf_config")
    if config is None and source_dir is not None:
        file = source_dir / "config.json"
        if not file.is_file():
            raise ConfigError(f"{weights.path} has no Hugging Face config and {file} (from model.name) is missing; "
                              "restore that folder, or export with --format safetensors")
        try:
            config = json.loads(file.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise ConfigError(f"{file} (from model.name) cannot be read as JSON ({exc}); restore it, or export with "
                              "--format safetensors") from None
    if not isinstance(config, dict) and config is not None:
        raise ConfigError(f"{weights.path}: its Hugging Face config is not a JSON object; export with --format "
                          "safetensors")
    if config is None:
        raise ConfigError(f"{weights.path} is not a checkpoint of a Hugging Face model (no hf_config, model.name = "
                          f"{name or '?'!r}); export its weights with --format safetensors")
    return dict(config), source_dir


def _dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ConfigError(f"--dtype {name!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[name]


def _refuse_existing(out: Path, force: bool, is_file: bool) -> None:
    if not out.exists():
        return
    if is_file and out.is_dir():
        raise ConfigError(f"'{out}' is a folder; --format safetensors writes one file: give OUT.safetensors")
    if not is_file and not out.is_dir():
        raise ConfigError(f"'{out}' is a file; --format hf writes a folder: give a new folder")
    if not force and (is_file or any(out.iterdir())):
        raise ConfigError(f"'{out}' exists and is not empty; choose a new OUT, or pass --force to replace it")


def _move_into(staging: Path, out: Path) -> None:
    """`staging`'s files into `out`: a rename when `out` is new or empty; with --force into an existing
    folder, its earlier weight files are removed first (as `save_pretrained` does), other files are kept."""
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    if not out.exists():
        os.replace(staging, out)
        return
    for stale in _weight_files(out):
        stale.unlink()
    for item in staging.iterdir():
        os.replace(item, out / item.name)


def _weight_files(folder: Path) -> Iterator[Path]:
    for item in folder.iterdir():
        if item.name in (WEIGHTS, INDEX) or re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", item.name):
            yield item
