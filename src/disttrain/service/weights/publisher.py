"""A weight sync's sending side, one per training rank (`Publisher`): it listens for consumers, builds this rank's
buckets (dense, or a delta on the consumer's version) beside the sending, and streams them to every consumer,
naming the one that is dead, slow or refuses."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy
import torch

from disttrain.checkpoint.statefile import safetensors_chunks
from disttrain.service.weights.pieces import Piece
from disttrain.service.wire import Connection, WireError, decode, frame


@dataclass
class _Consumer:
    name: str
    pid: int
    peer: str
    conn: Connection
    version: int = 0  # the version it acknowledged last

    def describe(self) -> str:
        return f"consumer {self.name!r} (pid {self.pid}, {self.peer})"


@dataclass
class _Bucket:
    meta: list[dict[str, Any]] = field(default_factory=list)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    nbytes: int = 0


def own_address(host: str) -> str:
    """The address a rank listens on for the consumers that reach the service at `host`: `host` itself where it is
    this machine's (loopback, or the driver's own address on its machine), else this machine's address on the route
    to `host` (a rank on another node cannot listen on the driver's address). A UDP socket's connect sends nothing;
    it only picks the route."""
    try:
        resolved = socket.gethostbyname(host)
    except OSError:
        return host
    if resolved.startswith("127."):
        return host
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((resolved, 9))
            return probe.getsockname()[0]
    except OSError:
        return host


class Publisher:
    """One rank's side: listens for consumers and streams this rank's pieces to each of them."""

    def __init__(self, host: str, token: str, keep_for_delta: bool):
        self.token, self.keep_for_delta = token, keep_for_delta
        here = own_address(host)
        self.sock = socket.create_server((here, 0))
        self.address = f"{here}:{self.sock.getsockname()[1]}"
        self.consumers: list[_Consumer] = []
        self._arrived = threading.Condition()
        self._sent: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}  # what the consumers at `version` hold
        self.version = 0
        self._closed = False
        threading.Thread(target=self._accept, name="disttrain-weights-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, peer = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._greet, args=(sock, peer), daemon=True).start()

    def _greet(self, sock: socket.socket, peer) -> None:
        sock.settimeout(10.0)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = Connection(sock)
        try:
            body, payload = conn.recv_raw()
            hello, _ = decode(body, payload)
            if hello.get("op") != "hello" or hello.get("token") != self.token or len(payload):
                raise WireError("not a consumer's hello with this sync's token")
        except (OSError, EOFError, WireError):
            conn.close()
            return
        consumer = _Consumer(str(hello.get("name", "?")), int(hello.get("pid", 0)), f"{peer[0]}:{peer[1]}", conn)
        with self._arrived:
            self.consumers.append(consumer)
            self._arrived.notify_all()

    def _wait_for(self, count: int, deadline: float) -> str | None:
        with self._arrived:
            while len(self.consumers) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    seen = ", ".join(repr(c.name) for c in self.consumers) or "none"
                    return (f"{count - len(self.consumers)} of {count} consumer(s) never connected to "
                            f"{self.address} (connected: {seen}); start each engine with this sync's endpoint")
                self._arrived.wait(left)
        return None

    def push(self, pieces: list[Piece], version: int, dtype: torch.dtype | None, bucket_bytes: int, delta: bool,
             wait_for: int, timeout_s: float) -> dict[str, Any]:
        """Send `version` to every connected consumer (waiting for `wait_for` of them first); a report with the
        bytes, seconds and per-consumer errors. Never raises for a consumer's failure: it drops that consumer."""
        start = time.monotonic()
        deadline = start + timeout_s
        missing = self._wait_for(wait_for, deadline)
        if missing:
            return {"version": version, "errors": [missing], "bytes": 0, "full_bytes": 0,
                    "seconds": time.monotonic() - start}
        base = self.version
        with self._arrived:
            consumers = list(self.consumers)
        deltas = [c for c in consumers if delta and base and self._sent and c.version == base]
        streams = {}  # one per kind of version the consumers need, built once, sent to each of them
        if deltas:
            streams["delta"] = _Stream(pieces, dtype, version, base, bucket_bytes, self._sent)
        if len(deltas) < len(consumers) or not consumers:
            streams["full"] = _Stream(pieces, dtype, version, 0, bucket_bytes, None)
        results: dict[int, str | None] = {}

        def send(consumer: _Consumer) -> None:
            results[id(consumer)] = _deliver(consumer, streams["delta" if consumer in deltas else "full"], version,
                                             deadline)

        threads = [threading.Thread(target=send, args=(c,), daemon=True) for c in consumers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for stream in streams.values():
            stream.wait()
        errors = []
        for consumer in consumers:
            error = results.get(id(consumer))
            if error is None:
                consumer.version = version
            else:
                errors.append(f"{consumer.describe()}: {error}")
                self._drop(consumer)
        self.version = version
        if self.keep_for_delta:
            self._sent = next(iter(streams.values())).values
        totals = {kind: stream.total for kind, stream in streams.items()}
        sent = sum(totals["delta" if c in deltas else "full"] for c in consumers)
        return {"version": version, "errors": errors, "seconds": time.monotonic() - start, "bytes": sent,
                "full_bytes": totals["full"] if "full" in totals else streams["delta"].dense_bytes(),
                "delta_bytes": totals.get("delta"),
                "consumers": [c.name for c in consumers if results.get(id(c)) is None]}

    def _drop(self, consumer: _Consumer) -> None:
        with self._arrived:
            if consumer in self.consumers:
                self.consumers.remove(consumer)
        consumer.conn.close()

    def close(self) -> None:
        self._closed = True
        self.sock.close()
        for consumer in list(self.consumers):
            self._drop(consumer)


class _Stream:
    """One version's frames (begin, buckets, end), built once and sent by every consumer thread that takes this kind
    (full or delta). With cores to spare a thread builds them bucket by bucket - the next bucket is cast and
    checksummed while the one before is on the wire; on a small machine they are built before sending. `values`
    fills as the buckets are built (what the consumers will hold)."""

    def __init__(self, pieces: list[Piece], dtype: torch.dtype | None, version: int, base: int, bucket_bytes: int,
                 previous: dict | None):
        self.frames: list[list] = []
        self.values: dict[tuple, torch.Tensor] = {}
        self.total = 0  # payload bytes
        self.done = False
        self.error: BaseException | None = None
        self._ready = threading.Condition()
        args = (pieces, dtype, version, base, bucket_bytes, previous)
        if (os.cpu_count() or 1) > 4:  # cores to spare: build beside the sending
            threading.Thread(target=self._produce, args=args, name="disttrain-weights-build", daemon=True).start()
        else:  # measured on 2 cores: a builder thread beside the senders and engines slows the whole sync down
            self._produce(*args)

    def _produce(self, *args) -> None:
        try:
            for chunks in self._build(*args):
                with self._ready:
                    self.frames.append(chunks)
                    self._ready.notify_all()
        except BaseException as exc:  # reported to every sender
            self.error = exc
        finally:
            with self._ready:
                self.done = True
                self._ready.notify_all()

    def get(self, index: int, deadline: float) -> list | None:
        """Frame `index` once built; None after the last one."""
        with self._ready:
            while index >= len(self.frames) and not self.done:
                if not self._ready.wait(max(deadline - time.monotonic(), 0.0)) and time.monotonic() > deadline:
                    raise TimeoutError
            if self.error is not None:
                raise RuntimeError(f"building the weights' buckets failed: {self.error}")
            return self.frames[index] if index < len(self.frames) else None

    def dense_bytes(self) -> int:
        """The bytes of every value once (what a full version's tensors hold, headers aside)."""
        return sum(v.numel() * v.element_size() for v in self.values.values())

    def wait(self) -> None:
        with self._ready:
            while not self.done:
                self._ready.wait()

    def _build(self, pieces: list[Piece], dtype, version: int, base: int, bucket_bytes: int, previous: dict | None):
        """With `previous` (the values the consumers hold at `base`), a tensor sends only its changed elements where
        that is smaller."""
        yield _message({"op": "begin", "version": version, "base": base})
        index, bucket = 0, _Bucket()
        for i, piece in enumerate(pieces):
            if piece.alias is not None:
                bucket.meta.append({"name": piece.name, "alias": piece.alias})
                continue
            key = (piece.name, tuple(piece.offset))
            value = self.values[key] = piece.local.detach().to("cpu", dtype or piece.local.dtype).contiguous()
            meta = {"name": piece.name, "shape": piece.shape, "offset": piece.offset, "local": list(value.shape),
                    "dtype": str(value.dtype).removeprefix("torch."), "key": i}
            tensors = {f"{i}": value}
            old = previous.get(key) if previous is not None else None
            if old is not None and old.shape == value.shape and old.dtype == value.dtype:
                mask = (_bits(old) != _bits(value)).view(-1)
                changed = mask.nonzero()[:, 0]
                n, k, size = value.numel(), changed.numel(), value.element_size()
                # the smallest of: every element; the changed ones' indices and values; a bit per element and values
                costs = {"dense": n * size, "index": k * (4 + size), "mask": (n + 7) // 8 + k * size}
                kind = min(costs, key=costs.get)
                if kind == "index":
                    tensors = {f"{i}.i": changed.to(torch.int32), f"{i}.v": value.view(-1)[changed]}
                elif kind == "mask":
                    tensors = {f"{i}.m": torch.from_numpy(numpy.packbits(mask.numpy())),
                               f"{i}.v": value.view(-1)[changed]}
                if kind != "dense":
                    meta["sparse"] = kind
            size = sum(t.numel() * t.element_size() for t in tensors.values())
            if bucket.tensors and bucket.nbytes + size > bucket_bytes:
                yield self._bucket_frame(bucket, version, index)
                index, bucket = index + 1, _Bucket()
            bucket.meta.append(meta)
            bucket.tensors.update(tensors)
            bucket.nbytes += size
        if bucket.meta:
            yield self._bucket_frame(bucket, version, index)
            index += 1
        yield _message({"op": "end", "version": version, "buckets": index})

    def _bucket_frame(self, bucket: _Bucket, version: int, index: int) -> list:
        payload = safetensors_chunks(bucket.tensors) if bucket.tensors else []
        crc = 0
        for chunk in payload:
            crc = zlib.crc32(chunk, crc)
        self.total += sum(memoryview(c).nbytes for c in payload)
        body = json.dumps({"op": "bucket", "version": version, "index": index, "crc32": crc, "pieces": bucket.meta},
                          separators=(",", ":")).encode()
        return frame(body, payload)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers (NaN equals NaN, -0 differs from 0): what changed on the wire."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _message(message: dict) -> list:
    return frame(json.dumps(message, separators=(",", ":")).encode(), [])


def _deliver(consumer: _Consumer, stream: _Stream, version: int, deadline: float) -> str | None:
    """Send the stream's frames as they are built and wait for the consumer's answer, all before `deadline`; None
    or what went wrong."""
    sock = consumer.conn.sock
    try:
        index = 0
        while (chunks := stream.get(index, deadline)) is not None:
            index += 1
            for chunk in chunks:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                sock.settimeout(left)
                sock.sendall(chunk)
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        answer, _ = consumer.conn.recv()
    except TimeoutError:
        return f"did not take version {version} within the timeout (slow, stopped or hung)"
    except (OSError, EOFError) as exc:
        return f"disconnected during version {version} ({type(exc).__name__}: {exc}); it may have died"
    except WireError as exc:
        return f"answered with a malformed frame ({exc})"
    if answer.get("op") == "ack" and answer.get("version") == version:
        return None
    return f"refused version {version}: {answer.get('error', answer)}"
