"""The worker tier in the open: forked processes that inherit the driver's objects.

    worker = Worker(work_fn)                 # fork; the child runs work_fn(conn) and exits
    worker.send({"cmd": "train"}, {"x": t})  # JSON + safetensors frames (wire.py), never pickle
    reply, tensors = worker.recv()
    workers = spawn_training_workers(4, work_fn)   # children run work_fn(conn, rank, world)

`os.fork()` + `socket.socketpair()`: the child starts with a copy of the parent's memory, so a model, optimizer or
loss function built in the driver reaches it without serialisation (copy-on-write pages, nothing pickled), and the
two talk over the socketpair in the service's frames. The TrainingService's local backend forks its workers this
way when it is given live objects (`as_service(model=..., optimizer=..., loss_fn=...)`, `ForkLauncher`); each then
serves on its end of a socketpair in the same frames that spawned workers use over TCP, so the service speaks one
wire whatever started its workers.

Forking is refused (`ForkUnsafe`, one line) where it is unsafe: other threads in the driver (a child gets a copy of
every lock they held, and none of the threads to release them) and CUDA initialised in the driver (a forked child
cannot use it). The fix is the import-path form (`model_fn="pkg.mod:factory"`), whose workers start fresh.
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from disttrain.errors import ConfigError
from disttrain.service.wire import Connection


def _native_threads() -> int:
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1


@functools.cache
def _after_import() -> int:
    """Native threads a fresh interpreter has after `import torch`, with this environment: the main thread and
    numpy's OpenBLAS pool, which starts with numpy and is fork-safe (it stops its threads around a fork with
    pthread_atfork). More than that here means threads started since: torch's OpenMP pool starts with the first
    parallel operation, and GNU OpenMP is not fork-safe. Asked once, of a child interpreter (about a second)."""
    code = "import os, torch; print(len(os.listdir('/proc/self/task')))"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
        return int(out.stdout.split()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return 1


INHERITED: dict[str, Any] = {}
"""The live objects of the service being forked (`ForkLauncher` sets them just before forking); a forked worker
reads them with `inherited`."""


class ForkUnsafe(ConfigError):
    """This process cannot fork workers safely (see the module docstring)."""


def fork_problem(gpu: bool = False) -> str | None:
    """Why forking this process now would be unsafe, or None. Counted: Python threads and native ones (GNU OpenMP,
    torch's intra-op pool on CPU, is not fork-safe: once a parallel operation ran here with more than one thread, a
    forked child that runs one hangs). tqdm's monitor thread, which any progress bar starts (transformers' loading
    among them), is stopped first: tqdm starts it again when a bar next needs it."""
    monitor, stopped = getattr(sys.modules.get("tqdm._monitor"), "TMonitor", None), False
    for thread in threading.enumerate():
        if monitor is not None and isinstance(thread, monitor):
            thread.exit()
            thread.join()
            stopped = True
    others = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
    if others:
        return f"{len(others)} other Python thread(s) run in this process ({', '.join(others[:3])})"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # (before counting native threads: CUDA starts its own)
        return "CUDA is already initialised in this process"
    if gpu and cuda_driver_loaded():  # (`gpu`: the children train on a GPU; CPU workers do not mind)
        return ("CUDA's driver already started in this process (torch.cuda.is_available() or a CUDA call did that; "
                "with PYTORCH_NVML_BASED_CUDA_CHECK=1 is_available() does not), and a forked worker cannot use it")
    # (the child interpreter's count is asked only when there is more than the main thread; it takes seconds on a
    # loaded host, so the threads are counted again after it)
    base = _after_import() if _native_threads() > 1 else 1
    # a thread just joined (tqdm's monitor) can still be listed in /proc/self/task for a moment after Python's join
    # returns (a suite run saw one): longer on a loaded host, so a stopped monitor is given more time
    native, deadline = _native_threads() - base, time.monotonic() + (5.0 if stopped else 1.0)
    while native > 0 and time.monotonic() < deadline:
        time.sleep(0.01)
        native = _native_threads() - base
    if native > 0:
        return (f"{native} native thread(s) run in this process (torch's CPU thread pool starts with its first "
                "parallel operation; call torch.set_num_threads(1) before building the model, the workers set their "
                "own)")
    return None


def cuda_driver_loaded() -> bool:
    """Whether the CUDA driver library is mapped into this process: `torch.cuda.is_available()` loads and starts it
    without `torch.cuda.is_initialized()` turning true, and a forked child cannot use a driver its parent started
    (workers that train on the CPU do not mind)."""
    try:
        return "libcuda.so" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def check_fork(what: str = "cannot fork workers", gpu: bool = False) -> None:
    """ForkUnsafe (one line, naming the fix) where `fork_problem` finds one."""
    problem = fork_problem(gpu)
    if problem:
        raise ForkUnsafe(f"{what}: {problem}; or pass import paths instead (model_fn='pkg.mod:factory', "
                         "optimizer_fn=..., loss_fn='pkg.mod:fn'), whose workers start as fresh processes")


def fork_process(fn: Callable[..., int | None], *args: Any, keep: tuple[int, ...] = (), gpu: bool = False) -> int:
    """Fork a child that runs `fn(*args)` and exits with its return value (0 unless an int; 1 if it raised, its
    traceback on stderr); returns the child's pid. The child starts a session of its own (Ctrl-C in the terminal
    reaches the driver, not every worker, as for spawned workers), dies with this process (`PR_SET_PDEATHSIG`), and
    leaves the sockets it inherited but `keep` (it holds none of the driver's connections: one the driver closes
    must reach its peer's end of file). `gpu`: the child will use a GPU."""
    check_fork(gpu=gpu)
    parent = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.setsid()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if "asyncio" in sys.modules:  # the driver's running loop is not the child's: asyncio.run works there
            sys.modules["asyncio"]._set_running_loop(None)
        die_with_parent(parent)
        _close_sockets(keep)
        result = fn(*args)
        code = result if isinstance(result, int) else 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # the child never returns into the parent's code
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:  # a closed pipe: nothing more to say
                pass
        os._exit(code)


def _close_sockets(keep: tuple[int, ...]) -> None:
    """Point every inherited socket but `keep` at /dev/null (`dup2`, not `close`: a Python socket object of the
    driver's may still close its number later, which must not hit a descriptor this child opened since)."""
    null = os.open(os.devnull, os.O_RDWR)
    for name in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else []:
        fd = int(name)
        try:
            if fd > 2 and fd != null and fd not in keep and stat.S_ISSOCK(os.fstat(fd).st_mode):
                os.dup2(null, fd)
        except OSError:  # the listing's own descriptor, already gone
            pass
    os.close(null)


def die_with_parent(parent: int) -> None:
    """Linux: the kernel SIGKILLs this process when its parent (the driver) exits, however it exits (even
    SIGKILL), so a dead driver never leaves workers behind; elsewhere a closed connection ends the worker."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the driver died before the request took effect
        os._exit(1)


class Child:
    """A forked process, seen through `subprocess.Popen`'s calls (`poll`, `wait`, `kill`)."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        """The exit code (negative: killed by that signal), or None while it runs."""
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)


class Worker(Child):
    """One forked process running `work_fn(conn, *args)`, with `conn` its end of a socketpair to this one."""

    def __init__(self, work_fn: Callable[..., int | None], *args: Any):
        mine, theirs = socket.socketpair()
        fd = theirs.detach()
        try:
            super().__init__(fork_process(_run, work_fn, fd, args, keep=(fd,)))
        except BaseException:
            mine.close()
            raise
        finally:
            os.close(fd)  # the child's end, in this process
        self.conn = Connection(mine)

    def send(self, message: dict[str, Any], tensors: dict | None = None) -> None:
        self.conn.send(message, tensors)

    def recv(self) -> tuple[dict[str, Any], dict]:
        """The child's next message; EOFError once it has closed its end (exited)."""
        return self.conn.recv()

    def close(self) -> None:
        """Kill the child if it still runs, reap it, close the connection."""
        self.kill()
        self.wait()
        self.conn.close()


def _run(work_fn: Callable[..., int | None], fd: int, args: tuple) -> int | None:
    return work_fn(Connection(socket.socket(fileno=fd)), *args)


def spawn_training_workers(n: int, work_fn: Callable[..., int | None]) -> list[Worker]:
    """`n` forked workers, the r-th running `work_fn(conn, r, n)` (a rank and the world size, to form a process
    group with, e.g. through `disttrain.runtime`). If one cannot be forked, those already forked are ended."""
    workers: list[Worker] = []
    try:
        for rank in range(n):
            workers.append(Worker(work_fn, rank, n))
    except BaseException:
        for worker in workers:
            worker.close()
        raise
    return workers


def inherited(name: str) -> Any:
    """A live object the driver passed to the service (`model`, `optimizer`, `loss_fn`), in a forked worker."""
    if name not in INHERITED:
        raise ValueError(f"{name}: no such object was given to the service (only forked workers inherit them)")
    return INHERITED[name]
