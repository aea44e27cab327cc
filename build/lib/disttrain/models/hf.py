"""Hugging Face causal language models: `model.name = "hf:DIR"`, a local directory written by `save_pretrained`.

The hub is never contacted. The model is built from `DIR/config.json` with its parameters on the meta device
(models/meta.py) and its weights are read from `DIR`'s safetensors by `read_rows`, which reads only the rows a
rank keeps: under fsdp/zero2/hsdp no rank ever holds the full model, and every strategy loads the same bytes. A
directory without weights gives a randomly initialised model (seeded by `run.seed`), built in full.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
from torch import nn

from disttrain.checkpoint.statefile import DTYPES_BY_NAME
from disttrain.errors import ConfigError
from disttrain.models.meta import defer, parameters_on_meta

PREFIX = "hf:"
INSTALL = "pip install 'disttrain[hf]'"


def is_hf_model(model: nn.Module) -> bool:
    """A transformers `PreTrainedModel` (checked without importing transformers when nothing has)."""
    if "transformers" not in sys.modules:
        return False
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


def hf_directory(name: str) -> Path:
    """The local directory of `model.name = "hf:DIR"`; a hub id or a missing directory is a one-line error."""
    path = Path(name[len(PREFIX):]).expanduser()
    if not path.is_dir():
        looks_like_hub_id = not path.is_absolute() and len(path.parts) == 2 and not name.startswith(("hf:.", "hf:~"))
        advice = (f"disttrain never downloads: fetch it first (`hf download {path} --local-dir DIR`) and give "
                  "model.name = 'hf:DIR'") if looks_like_hub_id else "give the directory save_pretrained wrote"
        raise ConfigError(f"model.name = {name!r}: '{path}' is not a local directory; {advice}")
    if not (path / "config.json").is_file():
        raise ConfigError(f"model.name = {name!r}: '{path}' has no config.json; give a directory written by "
                          "save_pretrained (model and config)")
    return path


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"model.name = 'hf:...' needs transformers: {INSTALL}") from None
    return transformers


def load_pretrained(name: str) -> nn.Module:
    """The causal LM of `hf:DIR`, its parameters on meta and its weights deferred to `materialize` (or, when
    DIR has no weights, built and randomly initialised)."""
    directory = hf_directory(name)
    transformers = _transformers()
    config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    files = weight_files(directory)
    if not files:
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with parameters_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.disttrain_weights = SafetensorsReader(files)  # reported by `bench startup`
    return defer(model, model.disttrain_weights)


def weight_files(directory: Path) -> list[Path]:
    """`model.safetensors`, or the shards its index lists; [] when there are no weights."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / shard for shard in shards]
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    if any(directory.glob("*.bin")):
        raise ConfigError(f"'{directory}' holds pickled *.bin weights, which disttrain does not load (no unpickling "
                          "from disk); convert them to safetensors (`model.save_pretrained(dir)` writes safetensors)")
    return []


class SafetensorsReader:
    """Reads rows of tensors from safetensors files with plain file reads (no mmap: the pages of other ranks'
    rows are never touched, so a rank's memory holds only what it keeps)."""

    def __init__(self, files: list[Path]):
        self.bytes_read = 0
        """Tensor bytes read so far (a rank of a sharded start reads about 1/N of the file)."""
        self.entries: dict[str, tuple[Path, int, str, list[int]]] = {}  # key -> (file, data start, dtype, shape)
        for path in files:
            with open(path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(size))
            for key, info in header.items():
                if key != "__metadata__":
                    start = 8 + size + info["data_offsets"][0]
                    self.entries[key] = (path, start, info["dtype"], info["shape"])

    def read_rows(self, key: str, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [start, stop) of dimension 0 of tensor `key` (a contiguous byte range of the file), read into `out`
        when it is given (contiguous, of the file's dtype and the rows' shape), else into a new tensor."""
        path, offset, dtype_name, shape = self.entries[key]
        dtype = DTYPES_BY_NAME[dtype_name]
        rows = [max(0, stop - start), *shape[1:]] if shape else []
        if out is None:
            out = torch.empty(rows, dtype=dtype)
        if out.numel():
            row = math.prod(shape[1:]) * dtype.itemsize
            with open(path, "rb") as f:
                f.seek(offset + start * row)
                self.bytes_read += f.readinto(out.view(-1).view(torch.uint8).numpy())
        return out

    def _read_into(self, key: str, start: int, stop: int, target: torch.Tensor) -> None:
        """Rows of `key` into `target`: straight from the file when layout and dtype allow (no second copy)."""
        dtype = DTYPES_BY_NAME[self.entries[key][2]]
        if target.is_contiguous() and target.device.type == "cpu" and target.dtype == dtype:
            self.read_rows(key, start, stop, out=target)
        else:
            target.copy_(self.read_rows(key, start, stop))

    def load_into(self, model: nn.Module, aliases: list[list[str]] = ()) -> None:
        """Fill each parameter (tied ones once) and each persistent buffer the files hold (`aliases`: meta.py)."""
        seen: set[int] = set()
        for name, param in model.named_parameters(remove_duplicate=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            self._fill(param, self._key(name, model, aliases))
        for name, buffer in model.named_buffers():
            if name in self.entries:
                self._fill(buffer, name)

    def load_tensor(self, model: nn.Module, name: str, tensor: torch.Tensor) -> None:
        """Fill one full parameter of `model` (tied names resolve to the tensor the files hold)."""
        self._fill(tensor, self._key(name, model))

    def _key(self, name: str, model: nn.Module, aliases: list[list[str]] = ()) -> str:
        if name in self.entries:
            return name
        tied = [n for n, p in model.named_parameters(remove_duplicate=False)
                if p is model.get_parameter(name) and n in self.entries]
        tied += [n for group in aliases if name in group for n in group if n in self.entries]
        if tied:
            return tied[0]
        raise ConfigError(f"the weights have no tensor '{name}' for {type(model).__name__}; give a directory that "
                          "save_pretrained wrote for this model's config")

    def _fill(self, tensor: torch.Tensor, key: str) -> None:
        shape = self.entries[key][3]
        if list(tensor.shape) != list(shape):
            raise ConfigError(f"weights tensor '{key}' has shape {shape}, the model's is {list(tensor.shape)}; "
                              "config.json and the safetensors files disagree")
        if not hasattr(tensor, "to_local"):
            self._read_into(key, 0, shape[0] if shape else 1, tensor)
            return
        local = tensor.to_local()
        from torch.distributed.tensor import distribute_tensor
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local_shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh,
                                                                    tensor.placements)
        if list(local_shape[1:]) == list(shape[1:]) and not any(offset[1:]):  # row shards: read only these rows
            self._read_into(key, offset[0], offset[0] + local_shape[0], local)
        else:  # other layouts (tensor parallel columns): one full tensor at a time, sliced locally
            full = self.read_rows(key, 0, shape[0])
            local.copy_(distribute_tensor(full, tensor.device_mesh, tensor.placements, src_data_rank=None).to_local())
