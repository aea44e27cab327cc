"""The driver's side of the worker tier: a `WorkerGroup` of N connected workers, started by a launcher
(`local_launcher.LocalLauncher`: child processes; `ray_launcher.RayLauncher`: Ray actors).

    group = WorkerGroup(LocalLauncher(), procs=2)
    await group.start()                                   # spawn, accept hellos, host the rendezvous store
    replies = await group.all([{"op": "setup", ...}] * 2) # one message per rank, replies in rank order
    await group.close()

The driver listens on `host` (loopback unless asked otherwise), for commands and for the torch rendezvous
store alike;
workers connect back and prove they were started by this driver with a random token. One reader task
per worker routes replies to the waiting call and records heartbeats. A monitor task declares a worker
failed when its process exits, its connection closes, or no frame (heartbeat or reply) has arrived for
`heartbeat_timeout_s`, or, given `progress_timeout_s`, when it has been in one training phase (`TIMED_PHASES`)
longer than that: of the workers over the limit, those not waiting in a collective (their heartbeats say, from
torch's flight recorder) are named, else those in their phase the longest. Every call waiting on the group then
fails with a `WorkerFailure` naming the worker, and `on_failure` is called (the service applies its policy there).
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from disttrain.monitor import the_waited_for
from disttrain.service.wire import TIMED_PHASES, WireError, encode, read_frame

log = logging.getLogger(__name__)


class WorkerFailure(RuntimeError):
    """A worker died, stopped responding, or left the group inconsistent; the message names it."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


class RemoteError(RuntimeError):
    """A command raised on a worker; the message carries the worker's exception and traceback."""

    def __init__(self, rank: int, kind: str, message: str, remote_traceback: str):
        super().__init__(f"rank {rank}: {kind}: {message}")
        self.rank, self.kind, self.remote_message, self.remote_traceback = rank, kind, message, remote_traceback


@dataclass
class WorkerHandle:
    rank: int
    pid: int
    host: str
    writer: asyncio.StreamWriter
    last_seen: float
    phase: str = "startup"
    phase_since: float = 0.0  # when it entered `phase`, on this machine's monotonic clock (0: not reported)
    in_collective: bool = False  # waiting in a collective, as its last heartbeat said (long phases only)
    warm: bool = False  # it finished an optimizer step in this process (before: the startup limit)
    step: int = 0
    node: str = ""
    closed: str | None = None  # why the connection ended
    rejected: str | None = None  # the worker refused a frame we sent
    pending: dict[int, asyncio.Future] = field(default_factory=dict)


class WorkerGroup:
    """N workers, one per rank, connected to this driver (see the module docstring)."""

    def __init__(self, launcher, procs: int, *, host: str = "127.0.0.1", heartbeat_s: float = 0.5,
                 heartbeat_timeout_s: float = 10.0, startup_timeout_s: float = 180.0, error_grace_s: float = 10.0,
                 progress_timeout_s: float = 0.0, on_failure: Callable[[WorkerFailure], None] | None = None):
        if procs < 1:
            raise ValueError(f"procs = {procs}: need at least one worker")
        self.launcher, self.procs, self.host = launcher, procs, host
        self.heartbeat_s, self.heartbeat_timeout_s = heartbeat_s, heartbeat_timeout_s
        self.startup_timeout_s, self.error_grace_s = startup_timeout_s, error_grace_s
        self.progress_timeout_s = progress_timeout_s  # 0: off
        self.on_failure = on_failure or (lambda failure: None)
        self.workers: dict[int, WorkerHandle] = {}
        self.failure: WorkerFailure | None = None
        self.store: Any = None
        self._token = secrets.token_hex(16)
        self._ids = itertools.count(1)
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()
        self._all_connected = asyncio.Event()
        self._closing = False

    @property
    def port(self) -> int:
        return self._server.sockets[0].getsockname()[1]

    async def start(self) -> None:
        """Spawn the workers and wait until all have connected; on any error or cancellation, everything
        started so far (server, store, processes, Ray actors) is stopped before the error propagates."""
        try:
            await self._start()
        except BaseException:
            await self.close(graceful=False)
            raise

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._accept, self.host, 0)
        # before the store: its server thread must not exist yet when a ForkLauncher forks this process
        connected = await self.launcher.spawn(self.host, self.port, self._token, self.procs, self.heartbeat_s)
        for sock in connected or ():  # forked workers: the driver's ends of their socketpairs
            reader, writer = await asyncio.open_connection(sock=sock)
            self._spawn_task(self._accept(reader, writer))
        # The rendezvous store of the workers' torch process group (they connect as clients, when `setup` tells
        # them its port). TCPStore binds to every interface when it opens its own port, so it gets a socket bound
        # to `host`.
        listener = socket.create_server((self.host, 0), backlog=128)
        self.store = torch.distributed.TCPStore(self.host, listener.getsockname()[1], self.procs,
                                                is_master=True, timeout=timedelta(seconds=self.startup_timeout_s),
                                                wait_for_workers=False, master_listen_fd=listener.fileno())
        listener.detach()  # the store owns the descriptor now (and closes it)
        deadline = time.monotonic() + self.startup_timeout_s
        while not self._all_connected.is_set():
            for rank in range(self.procs):
                status = self.launcher.exit_status(rank)
                if status is not None and rank not in self.workers:
                    raise WorkerFailure(f"worker {rank} {status} before connecting to the driver "
                                        "(see its output above)", rank)
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.procs)) - set(self.workers))
                raise WorkerFailure(f"worker(s) {missing} did not connect within {self.startup_timeout_s:g} s",
                                    missing[0])
            try:
                await asyncio.wait_for(self._all_connected.wait(), 0.1)
            except asyncio.TimeoutError:
                pass
        self._spawn_task(self._monitor())

    def _spawn_task(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- connections -------------------------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:  # before the token is checked, accept only a small hello without tensors
            hello, _ = await asyncio.wait_for(read_frame(reader, max_json=4096, max_payload=0), 30)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, WireError, ConnectionError):
            writer.close()
            return
        rank = hello.get("rank")
        token = str(hello.get("token", "")).encode()
        valid = (hello.get("op") == "hello" and isinstance(rank, int) and 0 <= rank < self.procs
                 and rank not in self.workers and hmac.compare_digest(token, self._token.encode()))
        if not valid:
            log.warning("refused a connection that is not one of this driver's workers")
            writer.close()
            return
        handle = WorkerHandle(rank, int(hello.get("pid", 0)), str(hello.get("host", "")), writer, time.monotonic(),
                              node=self.launcher.node(rank))
        self.workers[rank] = handle
        if len(self.workers) == self.procs:
            self._all_connected.set()
        await self._read_loop(handle, reader)

    async def _read_loop(self, handle: WorkerHandle, reader: asyncio.StreamReader) -> None:
        try:
            def alive():
                handle.last_seen = time.monotonic()

            while True:
                message, tensors = await read_frame(reader, on_progress=alive)
                alive()
                op = message.get("op")
                if op == "heartbeat":
                    handle.phase, handle.step = message.get("phase", ""), int(message.get("step", 0))
                    handle.phase_since = handle.last_seen - float(message.get("in_phase_s", 0.0))
                    handle.in_collective = bool(message.get("in_collective", False))
                    handle.warm = bool(message.get("warm", False))
                    continue
                if op == "rejected":
                    handle.rejected = str(message.get("error"))
                    continue
                handle.phase, handle.phase_since = "idle", handle.last_seen  # a reply: the command is over
                future = handle.pending.pop(message.get("id"), None)
                if future is None or future.done():
                    continue
                if message.get("ok"):
                    future.set_result((message, tensors))
                else:
                    future.set_exception(RemoteError(handle.rank, message.get("type", "Error"),
                                                     message.get("error", ""), message.get("traceback", "")))
        except (asyncio.IncompleteReadError, ConnectionError, WireError, OSError) as exc:
            closed = "closed its connection" if isinstance(exc, asyncio.IncompleteReadError) else str(exc)
        # A dead process's socket usually closes before the process can be reaped: wait briefly, so the
        # failure says how the worker ended (e.g. killed by SIGKILL) rather than only that it hung up.
        deadline = time.monotonic() + 2.0
        while self.launcher.exit_status(handle.rank) is None and time.monotonic() < deadline and not self._closing:
            await asyncio.sleep(0.02)
        handle.closed = closed
        self._check(handle)

    # -- health ------------------------------------------------------------------------------------

    async def _monitor(self) -> None:
        tick = max(0.05, min(self.heartbeat_s, self.heartbeat_timeout_s / 4))
        while not self._closing and self.failure is None:
            for handle in list(self.workers.values()):
                try:
                    self._check(handle)
                except Exception as exc:  # never let the detector die silently
                    self.fail(WorkerFailure(f"health check of worker {handle.rank} failed: {exc}", handle.rank))
            try:
                self._check_progress()
            except Exception as exc:  # (as above)
                self.fail(WorkerFailure(f"progress check of the workers failed: {exc}"))
            await asyncio.sleep(tick)

    def _limit(self, handle: WorkerHandle) -> tuple[str, float]:
        """The time limit of `handle`'s phase: `startup_timeout_s` until its first optimizer step in this process
        (a cold start: lazily made communicators, first allocations), as the Trainer's step 0."""
        if handle.warm:
            return "timeout_s", self.progress_timeout_s
        return "startup_timeout_s", max(self.startup_timeout_s, self.progress_timeout_s)

    def _check_progress(self) -> None:
        """Fail the group naming the worker(s) the others wait for, once one is past its limit in a training phase."""
        if not self.progress_timeout_s or self._closing or self.failure is not None:
            return
        now = time.monotonic()
        live = [h for h in self.workers.values() if h.phase in TIMED_PHASES and h.phase_since]
        over = [h for h in live if now - h.phase_since > self._limit(h)[1]]
        if not over:
            return
        stuck = the_waited_for(over, live, lambda h: h.phase_since, lambda h: h.in_collective)
        names = "; ".join(f"worker {h.rank} (pid {h.pid} on {h.host}) in phase '{h.phase}' at step {h.step} for "
                          f"{now - h.phase_since:.0f} s" for h in stuck)
        setting, limit = self._limit(over[0])
        waiting = [str(h.rank) for h in live if h.in_collective and h not in stuck]
        waits = f"; worker(s) {', '.join(waiting)} waited for it in a collective" if waiting else ""
        self.fail(WorkerFailure(f"{names}: no progress (limit {setting} = {limit:g}){waits}", stuck[0].rank))

    def _check(self, handle: WorkerHandle) -> None:
        """Declare `handle`'s worker failed if it exited, hung up or went silent."""
        if self._closing or self.failure is not None:
            return
        where = f"worker {handle.rank} (pid {handle.pid} on {handle.host})"
        status = self.launcher.exit_status(handle.rank)
        silent = time.monotonic() - handle.last_seen
        if status is not None:
            reason = f"{where} {status}"
        elif handle.closed is not None:
            reason = f"{where} {handle.closed}" + (f" after rejecting a frame: {handle.rejected}"
                                                    if handle.rejected else "")
        elif silent > self.heartbeat_timeout_s:
            reason = (f"{where} sent no heartbeat for {silent:.1f} s (limit heartbeat_timeout_s = "
                      f"{self.heartbeat_timeout_s:g}); last phase '{handle.phase}' at step {handle.step}")
        else:
            return
        self.fail(WorkerFailure(reason, handle.rank))

    def fail(self, failure: WorkerFailure) -> None:
        """Mark the group failed: every waiting call raises `failure`; `on_failure` applies the policy."""
        if self.failure is not None or self._closing:
            return
        self.failure = failure
        log.error("%s", failure)
        for handle in self.workers.values():
            for future in handle.pending.values():
                if not future.done():
                    future.set_exception(failure)
            handle.pending.clear()
            handle.writer.transport.abort()  # unblocks a drain() to a worker that stopped reading
        self.on_failure(failure)

    def status(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        out = []
        for rank in range(self.procs):
            handle = self.workers.get(rank)
            if handle is None:
                out.append({"rank": rank, "state": "starting"})
                continue
            exit_status = self.launcher.exit_status(rank)
            state = "dead" if exit_status or handle.closed else (
                "unresponsive" if now - handle.last_seen > self.heartbeat_timeout_s else "healthy")
            entry = {"rank": rank, "state": state, "pid": handle.pid, "host": handle.host, "node": handle.node,
                     "phase": handle.phase, "step": handle.step, "last_heartbeat_s": round(now - handle.last_seen, 3)}
            if getattr(self.launcher, "gpus", None):  # Ray: the GPU ids it gave the worker
                entry["gpus"] = self.launcher.gpus[rank]
            if exit_status:
                entry["exit"] = exit_status
            out.append(entry)
        return out

    # -- commands ----------------------------------------------------------------------------------

    def send(self, rank: int, message: dict[str, Any], tensors: dict | None = None) -> asyncio.Future:
        """Send one command to one worker; the future resolves to (reply, tensors)."""
        if self.failure is not None:
            raise self.failure
        return self._write(rank, *self._frame(message, tensors))

    def _frame(self, message: dict[str, Any], tensors: dict | None) -> tuple[int, list[bytes]]:
        ident = next(self._ids)
        return ident, encode({**message, "id": ident}, tensors)

    def _write(self, rank: int, ident: int, chunks: list[bytes]) -> asyncio.Future:
        handle = self.workers[rank]
        future = asyncio.get_running_loop().create_future()
        handle.pending[ident] = future
        for chunk in chunks:
            handle.writer.write(chunk)
        return future

    async def all(self, messages: list[tuple[dict[str, Any], dict | None]]) -> list[tuple[dict, dict]]:
        """Send `messages[r]` to rank r (all ranks run the command together) and gather the replies.

        A command that fails on some rank raises its RemoteError once every rank has answered; if the
        other ranks do not answer within `error_grace_s` (stuck in a collective the failed rank never
        joined), the group is failed too, since its ranks no longer agree on where they are.
        """
        if self.failure is not None:
            raise self.failure
        # every frame is encoded before any is sent: a command never starts on some ranks only
        frames = [self._frame(message, tensors) for message, tensors in messages]
        futures = [self._write(rank, ident, chunks) for rank, (ident, chunks) in enumerate(frames)]
        # A worker that just died makes drain() fail; its reader task declares the failure, which then
        # resolves every future below with a WorkerFailure naming the worker.
        await asyncio.gather(*(self.workers[r].writer.drain() for r in range(self.procs)), return_exceptions=True)
        done, pending = await asyncio.wait(futures, return_when=asyncio.FIRST_EXCEPTION)
        if pending:
            first = next(f.exception() for f in done if f.exception() is not None)
            if isinstance(first, WorkerFailure):
                raise first
            _, pending = await asyncio.wait(pending, timeout=self.error_grace_s)
            if pending:
                self.fail(WorkerFailure(f"{first}; the other ranks did not finish the command within "
                                        f"{self.error_grace_s:g} s, so the group is out of step", first.rank))
                raise self.failure or first
        errors = [future.exception() for future in futures if future.done()]  # retrieves every error
        if self.failure is not None:  # a worker died: the other ranks' errors (peer reset) are its echoes
            raise self.failure
        first = next((error for error in errors if error is not None), None)
        if first is not None:
            if any(error is None for error in errors):  # some ranks ran it, some failed: out of step
                self.fail(WorkerFailure(f"{first}; the other ranks completed the command, so the group is "
                                        "out of step", first.rank))
                raise self.failure or first
            raise first
        return [future.result() for future in futures]

    async def close(self, graceful: bool = True, timeout_s: float = 30.0) -> None:
        """Shut the workers down (a `shutdown` command each when `graceful`), then stop the server."""
        self._closing = True  # from here on, workers hanging up is expected
        if graceful and self.failure is None and len(self.workers) == self.procs:
            try:
                await asyncio.wait_for(self.all([({"op": "shutdown"}, None)] * self.procs), timeout_s)
            except (Exception, asyncio.TimeoutError) as exc:  # still close everything below
                log.warning("workers did not shut down cleanly: %s", exc)
        await (self.launcher.stop(timeout_s) if graceful else self.launcher.kill())
        for handle in self.workers.values():
            handle.writer.close()
        for task in list(self._tasks):
            task.cancel()
        if self._server is not None:
            self._server.close()
        self.store = None
