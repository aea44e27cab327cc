"""Datasets and the deterministic distributed sampler.

The sampler defines one global stream of samples: position p of the stream is sample
`perm(seed, p // N)[p % N]` of an N-sample dataset, where `perm(seed, epoch)` is a fixed permutation.
Optimizer step s consumes positions [s*G, (s+1)*G) for a global batch G; rank r of W takes the r-th
contiguous slice of G/W positions. So the stream never depends on the world size, and a checkpoint that
stores the cursor (positions consumed) resumes the same stream on any number of ranks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate

from disttrain.config import ConfigError, DataConfig
from disttrain.corpus import token_stream

IGNORE_INDEX = -100
"""Label value of padding tokens: excluded from the loss and from the token count."""


# ----------------------------------------------------------------------------------------------
# Token sources


@functools.lru_cache(maxsize=2)
def synthetic_corpus(n_bytes: int = 1 << 20, seed: int = 1234, n_words: int = 50) -> np.ndarray:
    """An offline text in a made-up language: 50 words, each followed by one of 4 likely successors.

    It is genuinely learnable (spelling is deterministic, the next word has ~1.8 bits of entropy), so
    the default GPT's loss falls from ln(256) ~ 5.5 to ~1.5 within 100 steps on a CPU.
    """
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = ["".join(rng.choice(letters, size=n)) for n in rng.integers(2, 8, size=n_words)]
    successors = rng.integers(0, len(words), size=(len(words), 4))
    picks = rng.choice(4, size=n_bytes // 3, p=[0.5, 0.25, 0.15, 0.1])
    stops = rng.random(n_bytes // 3) < 0.08
    out, word, size = [], 0, 0
    for pick, stop in zip(picks.tolist(), stops.tolist(), strict=True):
        word = successors[word, pick]
        piece = words[word] + (". " if stop else " ")
        out.append(piece)
        size += len(piece)
        if size >= n_bytes:
            break
    return np.frombuffer("".join(out).encode()[:n_bytes], dtype=np.uint8)


def load_tokens(cfg: DataConfig) -> np.ndarray:
    """The token array for `data.source`: built-in text, a text file (bytes), documents tokenised with
    `data.tokenizer` (cached; see corpus.py) or a memory-mapped token file."""
    if cfg.source == "builtin":
        return synthetic_corpus()
    if cfg.tokenizer:
        return token_stream(cfg.source, cfg.tokenizer, cfg.text_field)
    path = Path(cfg.source)
    if path.suffix == ".npy":
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise ConfigError(f"data.source = '{path}': expected a 1-D integer array, got "
                              f"{tokens.dtype} with shape {tokens.shape}")
        return tokens
    if path.suffix == ".bin":
        return np.memmap(path, dtype=np.dtype(cfg.token_dtype), mode="r")
    return np.frombuffer(path.read_bytes(), dtype=np.uint8)


class TokenWindows(Dataset):
    """Non-overlapping windows of the token stream, in one of the two label conventions (losses.py):
    `aligned=False` (disttrain's): inputs are the first seq_len of seq_len + 1 tokens, labels the same shifted
    by one; `aligned=True` (Hugging Face's): inputs are seq_len tokens and labels equal them (the loss shifts)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, aligned: bool = False):
        self.tokens, self.seq_len, self.aligned = tokens, seq_len, aligned

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - (0 if self.aligned else 1)) // self.seq_len)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        start = i * self.seq_len
        if self.aligned:
            window = torch.from_numpy(np.asarray(self.tokens[start:start + self.seq_len], dtype=np.int64))
            return {"input_ids": window, "labels": window.clone()}
        window = torch.from_numpy(np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int64))
        return {"input_ids": window[:-1], "labels": window[1:]}


def build_datasets(cfg: DataConfig, seq_len: int, aligned: bool = False) -> tuple[TokenWindows, TokenWindows]:
    """Train and validation windows (`aligned`: labels in HF's convention); validation is the last
    `val_fraction` of the tokens."""
    tokens = load_tokens(cfg)
    split = int(len(tokens) * (1.0 - cfg.val_fraction))
    train, val = TokenWindows(tokens[:split], seq_len, aligned), TokenWindows(tokens[split:], seq_len, aligned)
    if len(train) == 0 or len(val) == 0:
        raise ConfigError(f"data.source = '{cfg.source}' has {len(tokens)} tokens: too few for "
                          f"model.seq_len = {seq_len} with data.val_fraction = {cfg.val_fraction}; "
                          "use more data or a shorter seq_len")
    return train, val


# ----------------------------------------------------------------------------------------------
# Sampling


class GlobalSampler:
    """The global sample stream of a dataset; see the module docstring."""

    def __init__(self, num_samples: int, seed: int, shuffle: bool = True):
        if num_samples <= 0:
            raise ValueError("cannot sample from an empty dataset")
        self.num_samples, self.seed, self.shuffle = num_samples, seed, shuffle

    @functools.lru_cache(maxsize=2)  # noqa: B019 - two epochs at most are live at a time
    def permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_samples)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def global_indices(self, start: int, count: int) -> list[int]:
        """Dataset indices at stream positions [start, start + count)."""
        out: list[int] = []
        pos = start
        while pos < start + count:
            epoch, offset = divmod(pos, self.num_samples)
            take = min(self.num_samples - offset, start + count - pos)
            out.extend(self.permutation(epoch)[offset:offset + take].tolist())
            pos += take
        return out

    def rank_indices(self, cursor: int, global_batch: int, world_size: int, rank: int) -> list[int]:
        """This rank's share of the global batch that starts at stream position `cursor`."""
        per_rank = global_batch // world_size
        return self.global_indices(cursor + rank * per_rank, per_rank)


def split_micro(indices: Sequence[int], micro_batch_size: int) -> list[list[int]]:
    return [list(indices[i:i + micro_batch_size]) for i in range(0, len(indices), micro_batch_size)]


def eval_shard(num_samples: int, world_size: int, rank: int) -> range:
    """Contiguous, disjoint shards that together cover every sample exactly once (sizes differ by <= 1)."""
    return range(num_samples * rank // world_size, num_samples * (rank + 1) // world_size)


PAD_VALUES = {"input_ids": 0, "labels": IGNORE_INDEX, "attention_mask": 0}
"""Right-padding value per key in `collate`; any other key is padded with 0."""


def collate(items: list[Any]) -> Any:
    """Dict items (disttrain's windows, a Hugging Face `datasets.Dataset`'s rows of python lists) become a dict of
    tensors: every sequence-valued key is right-padded to the batch's longest sequence (so labels line up with
    input_ids), input_ids and attention_mask with 0,
    labels with IGNORE_INDEX (so padding never counts), others with 0; scalar keys are stacked. Anything else goes
    through torch's default_collate."""
    if not items or not isinstance(items[0], Mapping):
        return default_collate(items)
    keys = list(items[0])
    _check_items(items, keys)
    length = max((_length(item[key]) for item in items for key in keys), default=0)
    return {key: _pad([item[key] for item in items], PAD_VALUES.get(key, 0), length) for key in keys}


def _check_items(items: list[Mapping], keys: list[str]) -> None:
    for row, item in enumerate(items):
        if list(item) != keys:
            raise ConfigError(f"collate: item {row} of a batch has keys {list(item)}, item 0 has {keys}; give every "
                              "item of the dataset the same keys")
        if "labels" in item and "input_ids" in item and _length(item["labels"]) > _length(item["input_ids"]):
            raise ConfigError(f"collate: an item has {_length(item['labels'])} labels for "
                              f"{_length(item['input_ids'])} input_ids; labels must not be longer than input_ids: "
                              "truncate the labels (or pad the inputs) in your dataset")


def _length(value: Any) -> int:
    return len(value) if _is_sequence(value) else 0


def _is_sequence(value: Any) -> bool:
    return (isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim >= 1) or isinstance(value, (list, tuple))


def _pad(values: list[Any], pad: int, length: int) -> Any:
    if not all(_is_sequence(v) for v in values):
        return default_collate(values)
    tensors = [v if isinstance(v, torch.Tensor) else torch.as_tensor(v) for v in values]
    first = tensors[0]
    if all(t.shape == first.shape for t in tensors) and first.shape[0] == length:
        return torch.stack(tensors)
    out = torch.full((len(tensors), length, *first.shape[1:]), pad, dtype=first.dtype)
    for row, tensor in enumerate(tensors):
        out[row, :tensor.shape[0]] = tensor
    return out


def fetch(dataset: Dataset, indices: Sequence[int], collate_fn: Callable[[list[Any]], Any] = collate) -> Any:
    """One batch built in this process (evaluation without workers, benchmarks, scripts)."""
    return collate_fn([dataset[i] for i in indices])
