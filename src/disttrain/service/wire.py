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
from collections.abc import Callable
from typing import Any

import torch

from disttrain.checkpoint.statefile import flatten, load_safetensors, safetensors_chunks, unflatten

MAGIC = b"DTW1"
PREFIX = struct.Struct("!4sIQ")
MAX_JSON_BYTES = 64 << 20
TOKEN_ENV = "DISTTRAIN_SERVICE_TOKEN"  # how a local worker learns the token that proves it to its driver
TIMED_PHASES = frozenset({"forward_backward", "forward", "backward", "optim_step", "optimizer"})
"""The commands and backend phases (a heartbeat's `phase`) the service's `timeout_s` limits (group.py), in which a
long heartbeat also says whether the rank waits in a collective (worker.py). Not `setup` (its own limits), `save` /
`load` (no limit, as a Trainer's checkpoint), `call` or a weight sync (the user's work, of any length)."""


class WireError(ValueError):
    """A frame that is not a well-formed disttrain message (wrong magic, bad JSON, bad tensor buffer)."""


def encode(message: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None) -> list[bytes | memoryview]:
    """The frame for `message` and `tensors`, as chunks to write in order. The tensors' bytes are views of the
    tensors themselves (`statefile.safetensors_chunks`): nothing is copied before the socket takes them, slices of
    one batch included."""
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > MAX_JSON_BYTES:  # the peer would reject it: say so here, where the cause is
        raise ValueError(f"a message with {len(body)} bytes of JSON (limit {MAX_JSON_BYTES}): send large "
                         "values as tensors, not as lists of numbers")
    return frame(body, safetensors_chunks(tensors) if tensors else [])


def frame(body: bytes, payload: list[bytes | memoryview]) -> list[bytes | memoryview]:
    """A frame's chunks from its JSON body and its payload's chunks (e.g. `safetensors_chunks`, checksummed first)."""
    return [PREFIX.pack(MAGIC, len(body), sum(memoryview(c).nbytes for c in payload)), body, *payload]


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


def decode(body: bytes, payload: torch.Tensor | bytes) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The message and its tensors; `payload` (the safetensors buffer, best a uint8 tensor the frame was read into)
    is not copied: the tensors are views of it."""
    try:
        message = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WireError(f"rejected a message whose header is not JSON ({exc})") from None
    if not isinstance(message, dict):
        raise WireError("rejected a message whose JSON header is not an object")
    if not len(payload):
        return message, {}
    if not isinstance(payload, torch.Tensor):
        payload = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    try:
        return message, load_safetensors(payload)
    except Exception as exc:  # struct, JSON, dtype, offset or shape errors of a malformed buffer
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
        """The next message; EOFError when the peer closed the connection. The tensors are read straight into
        one buffer they then view (one copy, from the socket)."""
        return decode(*self.recv_raw())

    def recv_raw(self, buffer_for: Callable[[int], torch.Tensor] | None = None) -> tuple[bytes, torch.Tensor]:
        """The next frame's JSON body and payload buffer, undecoded (to checksum the payload before trusting it).
        `buffer_for(n)`: where the payload's n bytes go (a recycled buffer), instead of a new one."""
        json_len, payload_len = parse_prefix(self._read(PREFIX.size))
        body = self._read(json_len)
        payload = buffer_for(payload_len) if buffer_for else torch.empty(payload_len, dtype=torch.uint8)
        view, got = memoryview(payload.numpy()), 0
        while got < payload_len:
            n = self._file.readinto(view[got:])
            if not n:
                raise EOFError("connection closed")
            got += n
        return body, payload

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
    payload = torch.empty(payload_len, dtype=torch.uint8)
    view, got = memoryview(payload.numpy()), 0
    while got < payload_len:
        chunk = await reader.readexactly(min(payload_len - got, 8 << 20))
        view[got:got + len(chunk)] = chunk  # into the one buffer the tensors will view
        got += len(chunk)
        if on_progress is not None:
            on_progress()
    return decode(body, payload)
