"""The local launcher: workers as child processes of the driver, in sessions of their own."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

from disttrain.service.wire import TOKEN_ENV


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:  # e.g. a real-time signal
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class LocalLauncher:
    """Workers as child processes of the driver (`python -m disttrain.service.worker`)."""

    name = "local"

    def __init__(self, env: dict[str, str] | None = None, log_dir: str | None = None):
        self.env = dict(env or {})
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen] = []
        self._logs: list[Any] = []

    async def spawn(self, host: str, port: int, token: str, procs: int, heartbeat_s: float) -> None:
        """Start the workers; they connect to host:port (a launcher whose workers are connected already returns
        the driver's ends of those connections instead)."""
        env = {**os.environ, **self.env, TOKEN_ENV: token}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH", "")]))
        for rank in range(procs):
            out = None
            if self.log_dir:
                os.makedirs(self.log_dir, exist_ok=True)
                out = open(os.path.join(self.log_dir, f"worker{rank}.log"), "ab")  # noqa: SIM115 (closed in kill)
                self._logs.append(out)
            cmd = [sys.executable, "-m", "disttrain.service.worker", "--connect", f"{host}:{port}",
                   "--rank", str(rank), "--world", str(procs), "--heartbeat", str(heartbeat_s),
                   "--parent", str(os.getpid())]
            # Own session: Ctrl-C in the terminal reaches the driver only (which stops the workers, or
            # dies and takes them along: see fork.die_with_parent), not every worker mid-step.
            self.procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                               start_new_session=True))

    def exit_status(self, rank: int) -> str | None:
        """None while the worker's process runs; else how it ended."""
        code = self.procs[rank].poll()
        return None if code is None else describe_exit(code)

    def node(self, rank: int) -> str:
        return "local"

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Wait for the workers to exit (after a shutdown command), then kill whatever is left."""
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await self.kill()

    async def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:  # (polled, not waited for in a thread: a later fork needs a thread-free driver)
            while proc.poll() is None:
                await asyncio.sleep(0.01)
        for out in self._logs:
            out.close()
        self._logs.clear()


class ForkLauncher(LocalLauncher):
    """Workers forked from the driver (fork.py), inheriting `live` (the model, optimizer, loss function objects
    the service was given); each gets its end of a socketpair and serves on it like a spawned worker on its TCP
    connection (`spawn` returns the driver's ends: the group reads them as it reads accepted connections)."""

    name = "fork"

    def __init__(self, live: dict[str, Any], env: dict[str, str] | None = None, log_dir: str | None = None,
                 gpu: bool = False):
        super().__init__(env, log_dir)
        self.live, self.gpu = live, gpu  # `gpu`: the workers train on a GPU (each fork checks the driver: restarts)

    async def spawn(self, host: str, port: int, token: str, procs: int, heartbeat_s: float
                    ) -> list[socket.socket]:
        from disttrain.service.fork import INHERITED, Child, fork_process

        INHERITED.update(self.live)  # what the children will see (and only they keep: cleared below)
        ends: list[socket.socket] = []
        try:
            for rank in range(procs):
                log = os.path.join(self.log_dir, f"worker{rank}.log") if self.log_dir else None
                mine, theirs = socket.socketpair()
                fd = theirs.detach()
                try:  # the child keeps only its own end of every socket this process holds
                    pid = fork_process(_serve_forked, fd, token, rank, procs, heartbeat_s, self.env, log, keep=(fd,),
                                       gpu=self.gpu)
                except BaseException:
                    mine.close()
                    raise
                finally:
                    os.close(fd)
                self.procs.append(Child(pid))
                ends.append(mine)
        except BaseException:
            for end in ends:
                end.close()
            raise
        finally:
            INHERITED.clear()
        return ends


def _serve_forked(fd: int, token: str, rank: int, world: int, heartbeat_s: float, env: dict[str, str],
                  log: str | None) -> int:
    from disttrain.service.worker import serve_on

    os.environ.update(env)
    if log:
        os.makedirs(os.path.dirname(log), exist_ok=True)
        with open(log, "ab") as out:
            os.dup2(out.fileno(), 1)
            os.dup2(out.fileno(), 2)
    return serve_on(socket.socket(fileno=fd), token, rank, world, heartbeat_s)
