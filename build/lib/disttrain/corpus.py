"""Documents -> one packed token stream, tokenised once with a local Hugging Face tokenizer and cached.

A `.jsonl` source holds one document per line (its `data.text_field`); a text source holds documents separated
by blank lines. Every document is tokenised without special tokens and followed by the tokenizer's EOS, and the
documents are concatenated in file order into one stream, which `TokenWindows` cuts into training windows.

The stream is cached next to the source as `<source>.<key>.tokens.npy`, where the key hashes the tokenizer's files,
the source's size and modification time and the text field: a changed source or tokenizer gets a new file, never a
stale one. The file is written to a temporary name and renamed (atomic); when several ranks start together the
first takes a lock on `<cache>.lock` and tokenises, the others wait for it and read the result (without a working
lock each rank would write the same bytes and rename them in turn: no reader ever sees a partial file).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from disttrain.errors import ConfigError

CACHE_VERSION = 1
"""Bumped when the packing rule changes, so old caches are not reused."""
BATCH_DOCS = 512


def load_tokenizer(directory: str) -> Any:
    """The tokenizer saved in a local folder; never a download."""
    if not Path(directory).is_dir():
        raise ConfigError(f"data.tokenizer = {directory!r} is not a local directory; give the folder of a Hugging "
                          "Face tokenizer (tokenizer.save_pretrained(DIR))")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"data.tokenizer = {directory!r}: not a loadable tokenizer folder ({first}); save one "
                          "there with tokenizer.save_pretrained(DIR)") from None
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"data.tokenizer = {directory!r} has no EOS token, which separates documents; set one "
                          "(tokenizer.eos_token = ...) and save it again")
    return tokenizer


def check_source(source: str, directory: str, text_field: str, vocab_size: int) -> None:
    """Before anything starts: the tokenizer loads from its folder, model.vocab_size covers every id it can
    produce, and a .jsonl source's first document is found under `text_field`."""
    tokenizer = load_tokenizer(directory)
    if vocab_size < len(tokenizer):
        raise ConfigError(f"model.vocab_size = {vocab_size} is smaller than the vocabulary of data.tokenizer = "
                          f"{directory!r} ({len(tokenizer)} tokens); set model.vocab_size = {len(tokenizer)} or more")
    if Path(source).suffix == ".jsonl":
        next(documents(source, text_field), None)


def cache_path(source: str, tokenizer_dir: str, text_field: str) -> Path:
    """Where the token stream of (source, tokenizer, text field) is cached."""
    digest = hashlib.sha256(f"v{CACHE_VERSION}|{text_field}|".encode())
    stat = Path(source).stat()
    digest.update(f"{stat.st_size}|{stat.st_mtime_ns}|".encode())
    for file in sorted(Path(tokenizer_dir).iterdir()):
        if file.is_file():
            digest.update(file.name.encode() + b"\0" + file.read_bytes())
    return Path(f"{source}.{digest.hexdigest()[:16]}.tokens.npy")


def documents(source: str, text_field: str) -> Iterator[str]:
    """The documents of a `.jsonl` file (one per line; blank lines skipped) or of a text file (separated by
    blank lines)."""
    path = Path(source)
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    yield _jsonl_text(line, number, source, text_field)
        return
    text = path.read_text(encoding="utf-8")
    for doc in re.split(r"\n[ \t]*\n", text):
        if doc.strip():
            yield doc.strip("\n")


def _jsonl_text(line: str, number: int, source: str, text_field: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"data.source = {source!r}, line {number}: not valid JSON ({exc.msg}); "
                          "fix the line (one JSON object per line)") from None
    if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ConfigError(f"data.source = {source!r}, line {number}: no string under data.text_field = "
                          f"{text_field!r} (keys: {keys}); set data.text_field to the key of the text")
    return record[text_field]


def tokenize(source: str, tokenizer: Any, text_field: str) -> np.ndarray:
    """Every document's ids followed by EOS, concatenated (uint16 when the vocabulary fits, else uint32)."""
    dtype = np.uint16 if len(tokenizer) <= 1 << 16 else np.uint32
    eos = np.array([tokenizer.eos_token_id], dtype=dtype)
    pieces: list[np.ndarray] = []
    batch: list[str] = []

    def flush() -> None:
        for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
            pieces.extend((np.asarray(ids, dtype=dtype), eos))
        batch.clear()

    for doc in documents(source, text_field):
        batch.append(doc)
        if len(batch) == BATCH_DOCS:
            flush()
    if batch:
        flush()
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)


def token_stream(source: str, tokenizer_dir: str, text_field: str) -> np.ndarray:
    """The cached token stream of `source` (memory-mapped), tokenising it first if no cache exists."""
    path = cache_path(source, tokenizer_dir, text_field)
    if not path.exists():
        tokenizer = load_tokenizer(tokenizer_dir)
        with open(f"{path}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # the first rank tokenises; the others wait here, then read
            if not path.exists():
                _save_atomic(path, tokenize(source, tokenizer, text_field))
    return np.load(path, mmap_mode="r", allow_pickle=False)


def _save_atomic(path: Path, tokens: np.ndarray) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        np.save(f, tokens, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
