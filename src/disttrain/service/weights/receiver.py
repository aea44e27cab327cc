"""A weight sync's receiving side, in an inference engine's process (`WeightReceiver`): it connects to every
training rank, checks each bucket's CRC-32, assembles the full tensors into recycled buffers and takes a version only
when every tensor is covered."""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
import zlib

import numpy
import torch

from disttrain.service.weights.pieces import DTYPES, SCHEME, WeightSyncError
from disttrain.service.wire import Connection, WireError, decode


class WeightReceiver:
    """An inference engine's side: connects to every training rank and assembles each version's full tensors.

    `receive()` blocks until the next version is complete and checked (returns its number; the weights are in
    `weights`, by the model's parameter names, in the dtype the sync sends), or raises `WeightSyncError` having
    refused it (a bucket's checksum failed, a tensor incomplete, a rank gone) and kept the previous weights.
    Two sets of tensors alternate (the next version is written into the one before the current): copy what you
    keep (`load_into` does) rather than holding `weights` across two versions."""

    def __init__(self, endpoint_: str, name: str = "engine", connect_timeout_s: float = 60.0,
                 recycle_from: int = 1 << 20):
        if not endpoint_.startswith(SCHEME) or "#" not in endpoint_:
            raise ValueError(f"endpoint {endpoint_!r}: expected {SCHEME}HOST:PORT[,HOST:PORT...]#TOKEN "
                             "(WeightSync.endpoint)")
        addresses, _, token = endpoint_.removeprefix(SCHEME).partition("#")
        self.name, self.version = name, 0
        self.weights: dict[str, torch.Tensor] = {}
        self._spare: dict[str, torch.Tensor] = {}  # the version before: the next version is written into it
        self.conns: list[Connection] = []
        self._frames: queue.Queue = queue.Queue()
        self._buffers = _BufferPool(recycle_from)
        for rank, address in enumerate(addresses.split(",")):
            host, _, port = address.rpartition(":")
            sock = socket.create_connection((host, int(port)), timeout=connect_timeout_s)
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = Connection(sock)
            conn.send({"op": "hello", "name": name, "token": token, "pid": os.getpid()})
            self.conns.append(conn)
            threading.Thread(target=self._read, args=(rank, conn), name=f"disttrain-weights-{rank}",
                             daemon=True).start()

    def _read(self, rank: int, conn: Connection) -> None:
        while True:
            try:
                body, payload = conn.recv_raw(self._buffers.take)
            except (OSError, EOFError, WireError) as exc:
                self._frames.put((rank, None, exc, 0))
                return
            # checksummed here, beside the other ranks' readers and the assembly (zlib releases the GIL)
            self._frames.put((rank, body, payload, zlib.crc32(payload.numpy()) if len(payload) else 0))

    def receive(self, timeout_s: float | None = None, on_bucket=None) -> int:
        """The next version (see the class docstring); `on_bucket(rank, index)` is called as buckets arrive."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        ended: dict[int, int] = {}
        begun: dict[int, dict] = {}
        staging: dict[str, torch.Tensor] | None = None
        covered: dict[str, dict[tuple, int]] = {}
        aliases: dict[str, str] = {}
        version, problem = None, None
        while len(ended) < len(self.conns):
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            try:
                rank, body, payload, crc = self._frames.get(timeout=left)
            except queue.Empty:
                raise WeightSyncError(f"{self.name}: no complete version within {timeout_s:g} s "
                                      f"(ranks done: {sorted(ended)} of {len(self.conns)})") from None
            if body is None:
                raise WeightSyncError(f"{self.name}: the connection to training rank {rank} broke ({payload}); "
                                      "the trainer stopped or dropped this consumer")
            try:
                message, tensors = decode(body, payload)
            except WireError as exc:
                self._buffers.give_back(payload)
                problem = problem or f"rank {rank} sent a malformed frame ({exc})"
                continue
            op = message.get("op")
            if op == "begin":
                begun[rank] = message
                version = message["version"] if version is None else version
                if staging is None:
                    base = int(message.get("base", 0))
                    if base and base != self.version:
                        problem = problem or f"a delta on version {base}, but this consumer holds {self.version}"
                    staging = {k: _reuse(self._spare, k, v).copy_(v) for k, v in self.weights.items()} if base else {}
            elif op == "bucket":
                if crc != message.get("crc32"):
                    problem = problem or (f"bucket {message.get('index')} from rank {rank} failed its checksum "
                                          f"(crc32 {crc:#010x}, sent {message.get('crc32', 0):#010x})")
                elif problem is None and staging is not None:
                    try:
                        _assemble(staging, covered, message["pieces"], tensors, self._spare, aliases)
                    except (KeyError, RuntimeError, ValueError) as exc:
                        problem = f"bucket {message.get('index')} from rank {rank} does not fit ({exc})"
                if on_bucket is not None:
                    on_bucket(rank, message.get("index"))
            elif op == "end":
                ended[rank] = int(message.get("buckets", 0))
            del tensors  # copied into staging: the payload's buffer can take the next bucket
            self._buffers.give_back(payload)
        if problem is None:
            missing = [n for n, t in (staging or {}).items() if n in covered and sum(covered[n].values()) != t.numel()]
            missing += [n for n, target in aliases.items() if target not in covered]
            if missing or not staging:
                problem = f"tensors not fully covered: {', '.join(missing[:5]) or 'none sent'}"
            for name, target in aliases.items():
                staging[name] = staging.get(target)
        if problem is not None:
            for conn in self.conns:
                conn.send({"op": "nack", "version": version, "error": problem})
            raise WeightSyncError(f"{self.name}: refused version {version}: {problem}; kept version {self.version}")
        self._spare, self.weights, self.version = self.weights, staging, int(version)
        for conn in self.conns:
            conn.send({"op": "ack", "version": self.version})
        return self.version

    def load_into(self, module: torch.nn.Module) -> None:
        """Copy the weights into `module` (same parameter names; cast to its dtypes)."""
        state = module.state_dict()
        unknown = sorted(set(self.weights) - set(state))
        if unknown:
            raise KeyError(f"{self.name}: the module has no {', '.join(unknown[:5])}")
        with torch.no_grad():
            for name, value in self.weights.items():
                state[name].copy_(value)

    def close(self) -> None:
        for conn in self.conns:
            conn.close()


class _BufferPool:
    """Receive buffers of payloads of `large` bytes and more (buckets), recycled: a fresh 64 MiB buffer per bucket
    costs its page faults and zeroing each time (a full sync of a 100M-parameter model took 0.49-0.64 s to 2 engines
    on 2 cores with fresh buffers, 0.26-0.37 s recycled). A buffer is handed back once its bucket was copied out; at
    most `keep` wait."""

    def __init__(self, large: int, keep: int = 4):
        self.large, self.keep, self._lock = max(large, 1), keep, threading.Lock()
        self._free: list[torch.Tensor] = []
        self._lent: dict[int, torch.Tensor] = {}  # by address: the whole buffer behind each payload handed out

    def take(self, n: int) -> torch.Tensor:
        if n < self.large:
            return torch.empty(n, dtype=torch.uint8)
        with self._lock:
            fits = next((i for i, buffer in enumerate(self._free) if buffer.numel() >= n), None)
            buffer = self._free.pop(fits) if fits is not None else torch.empty(n, dtype=torch.uint8)
            self._lent[buffer.data_ptr()] = buffer
        return buffer[:n]

    def give_back(self, payload: torch.Tensor) -> None:
        with self._lock:
            buffer = self._lent.pop(payload.data_ptr(), None)
            if buffer is not None and len(self._free) < self.keep:
                self._free.append(buffer)


def _reuse(spare: dict[str, torch.Tensor], name: str, like: torch.Tensor) -> torch.Tensor:
    """The spare tensor of `name` if it has `like`'s shape and dtype (no allocation, no page faults), else new."""
    old = spare.get(name)
    if old is not None and old.shape == like.shape and old.dtype == like.dtype:
        return old
    return torch.empty(like.shape, dtype=like.dtype)


def _assemble(staging: dict[str, torch.Tensor], covered: dict, pieces: list[dict], tensors: dict,
              spare: dict[str, torch.Tensor], aliases: dict[str, str]) -> None:
    for meta in pieces:
        if "alias" in meta:
            aliases[meta["name"]] = meta["alias"]
            continue
        name, shape, key = meta["name"], meta["shape"], meta["key"]
        dtype = DTYPES.get(meta["dtype"]) or getattr(torch, meta["dtype"])
        whole = staging.get(name)
        if whole is None or list(whole.shape) != shape or whole.dtype != dtype:
            if meta.get("sparse"):
                raise ValueError(f"a delta for {name}, which this consumer does not hold")
            whole = staging[name] = _reuse(spare, name, torch.empty(shape, dtype=dtype, device="meta"))
        region = whole
        for dim, (start, length) in enumerate(zip(meta["offset"], meta["local"], strict=True)):
            region = region.narrow(dim, start, length)
        if meta.get("sparse"):
            flat = region.contiguous().view(-1)
            if meta["sparse"] == "mask":
                where = numpy.unpackbits(tensors[f"{key}.m"].numpy(), count=flat.numel()).astype(bool)
                flat[torch.from_numpy(where)] = tensors[f"{key}.v"]
            else:
                flat[tensors[f"{key}.i"].long()] = tensors[f"{key}.v"]
            region.copy_(flat.view(region.shape))
        else:
            region.copy_(tensors[f"{key}"])
        covered.setdefault(name, {})[tuple(meta["offset"])] = region.numel()
