"""The driver <-> worker wire format: one JSON message plus named tensors as a safetensors buffer. No pickle.

A frame is `MAGIC` (4 bytes) | JSON length (u32) | payload length (u64) | JSON (UTF-8) | payload, where
the payload is empty or a safetensors buffer (a JSON header of dtypes, shapes and offsets, then raw
bytes). Both halves are parsed by formats that can only produce data, never run code: anything else, a
pickle included, fails the magic or the parse and is rejected with a `WireError`.

Structured values (a batch that is a dict, tuple or list of tensors and numbers) travel as a JSON
skeleton plus the tensors it references (`statefile.flatten`, the same encoding checkpoints use).
`split_batch` / `concat` cut such a value into per-rank (or per-micro-batch) slices and join outputs back.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from disttrain.checkpoint.statefile import flatten, unflatten

MAGIC = b"DTW1"
PREFIX = struct.Struct("!4sIQ")
MAX_JSON_BYTES = 64 << 20
TOKEN_ENV = "DISTTRAIN_SERVICE_TOKEN"  # how a local worker learns the token that proves it to its driver


class WireError(ValueError):
    """A frame that is not a well-formed disttrain message (wrong magic, bad JSON, bad tensor buffer)."""


def encode(message: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None) -> list[bytes]:
    """The frame for `message` and `tensors`, as chunks to write in order."""
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > MAX_JSON_BYTES:  # the peer would reject it: say so here, where the cause is
        raise ValueError(f"a message with {len(body)} bytes of JSON (limit {MAX_JSON_BYTES}): send large "
                         "values as tensors, not as lists of numbers")
    payload = b""
    if tensors:
        payload = save_safetensors({k: _own_storage(t) for k, t in tensors.items()})
    return [PREFIX.pack(MAGIC, len(body), len(payload)), body, payload]


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """safetensors refuses tensors that share memory (e.g. slices of one batch): copy those only."""
    t = t.detach().cpu().contiguous()
    return t if t.untyped_storage().nbytes() == t.nbytes else t.clone()


def parse_prefix(prefix: bytes) -> tuple[int, int]:
    """(JSON length, payload length) from a frame's first bytes; a foreign stream fails here."""
    magic, json_len, payload_len = PREFIX.unpack(prefix)
    if magic != MAGIC:
        kind = "a pickle" if prefix[:1] == b"\x80" else "not a disttrain frame"
        raise WireError(f"rejected a message that is {kind} (first bytes {prefix[:8]!r}); the wire carries "
                        "JSON and safetensors only")
    if json_len > MAX_JSON_BYTES:
        raise WireError(f"rejected a message with a {json_len}-byte JSON header (limit {MAX_JSON_BYTES})")
    return json_len, payload_len


def decode(body: bytes, payload: bytes) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    try:
        message = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WireError(f"rejected a message whose header is not JSON ({exc})") from None
    if not isinstance(message, dict):
        raise WireError("rejected a message whose JSON header is not an object")
    if not payload:
        return message, {}
    try:
        return message, load_safetensors(payload)
    except Exception as exc:  # safetensors raises its own error types for malformed buffers
        raise WireError(f"rejected a message whose tensors are not a safetensors buffer ({exc})") from None


def pack(value: Any, prefix: str = "") -> tuple[Any, dict[str, torch.Tensor]]:
    """(JSON skeleton, tensors) for a nested value; `unpack` inverts it."""
    return flatten(value, {}, prefix)


def unpack(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    return unflatten(skeleton, tensors)


def split_batch(batch: Any, n: int, allow_empty: bool = False) -> list[Any]:
    """`n` contiguous slices along dim 0 of every tensor in `batch` (as the sampler gives rank r the r-th
    slice of the global batch); numbers, strings and 0-d tensors go to every slice unchanged."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            return [batch] * n
        if len(batch) < n and not allow_empty:
            raise ValueError(f"a batch of {len(batch)} rows cannot be split over {n} workers; send at least {n}")
        return list(torch.tensor_split(batch, n))
    if isinstance(batch, dict):
        parts = {k: split_batch(v, n, allow_empty) for k, v in batch.items()}
        return [{k: parts[k][i] for k in batch} for i in range(n)]
    if isinstance(batch, (list, tuple)):
        parts = [split_batch(v, n, allow_empty) for v in batch]
        return [type(batch)(p[i] for p in parts) for i in range(n)]
    return [batch] * n


def concat(parts: list[Any]) -> Any:
    """Inverse of `split_batch` for per-rank outputs."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts) if first.dim() else first
    if isinstance(first, dict):
        return {k: concat([p[k] for p in parts]) for k in first}
    if isinstance(first, (list, tuple)):
        return type(first)(concat([p[i] for p in parts]) for i in range(len(first)))
    return first


def rows(value: Any) -> int:
    """Rows (dim 0) of the largest tensor in a nested batch."""
    if isinstance(value, torch.Tensor):
        return len(value) if value.dim() else 0
    if isinstance(value, dict):
        return max((rows(v) for v in value.values()), default=0)
    if isinstance(value, (list, tuple)):
        return max((rows(v) for v in value), default=0)
    return 0


class Connection:
    """A blocking framed socket (the worker's side). `send` may be called from several threads."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._send_lock = threading.Lock()
        self._file = sock.makefile("rb")

    def send(self, message: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None) -> None:
        chunks = encode(message, tensors)
        with self._send_lock:
            for chunk in chunks:
                self.sock.sendall(chunk)

    def recv(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The next message; EOFError when the peer closed the connection."""
        json_len, payload_len = parse_prefix(self._read(PREFIX.size))
        return decode(self._read(json_len), self._read(payload_len))

    def _read(self, n: int) -> bytes:
        data = self._file.read(n)
        if len(data) < n:
            raise EOFError("connection closed")
        return data

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


async def read_frame(reader: asyncio.StreamReader, on_progress=None, max_json: int = MAX_JSON_BYTES,
                     max_payload: int | None = None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The next message from an asyncio stream (the driver's side); IncompleteReadError at EOF.

    `on_progress()` is called as bytes arrive (a large frame in transit is a live peer); `max_json` and
    `max_payload` refuse larger frames before reading them (e.g. an unauthenticated hello)."""
    json_len, payload_len = parse_prefix(await reader.readexactly(PREFIX.size))
    if json_len > max_json or (max_payload is not None and payload_len > max_payload):
        raise WireError(f"rejected a frame of {json_len} + {payload_len} bytes (limits {max_json} + {max_payload})")
    body = await reader.readexactly(json_len)
    chunks, left = [], payload_len
    while left:
        chunks.append(await reader.readexactly(min(left, 8 << 20)))
        left -= len(chunks[-1])
        if on_progress is not None:
            on_progress()
    return decode(body, b"".join(chunks) if len(chunks) != 1 else chunks[0])
