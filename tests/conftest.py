"""Shared helpers: run the real CLI in a subprocess with a bounded wait, read metrics, find leftovers."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
DISTTRAIN = [sys.executable, "-m", "disttrain"]
T = TypeVar("T")


def cli_env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    # the source tree these tests belong to comes first (not another checkout's editable install)
    env.update(OMP_NUM_THREADS="1", TMPDIR=str(tmp_path), PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(SCRIPTS)]))
    return env


def run_cli(args: list[str], tmp_path: Path, timeout: float = 120, env: dict | None = None
            ) -> subprocess.CompletedProcess:
    """`disttrain ARGS` in `tmp_path`; if it outlives `timeout` seconds its whole process group (workers
    included) is killed and the test fails. The command's process is forked from the session's preloaded CLI
    server (cli_server.py: it skips the ~2 s import of torch) unless DISTTRAIN_TEST_FORK=0."""
    env = {**cli_env(tmp_path), **(env or {})}
    if os.environ.get("DISTTRAIN_TEST_FORK", "1") != "0":
        done = _server().run(args, tmp_path, env, timeout)
        if done is not None:
            return done
    proc = subprocess.Popen(DISTTRAIN + args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"disttrain {' '.join(args)} ran over {timeout}s; stderr tail:\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


class CliServer:
    """The client of cli_server.py: one server per test session, started on the first command."""

    def __init__(self) -> None:
        import tempfile

        self.dir = Path(tempfile.mkdtemp(prefix="dt-cli-", dir="/tmp"))  # short: an AF_UNIX path has ~100 bytes
        self.socket = str(self.dir / "socket")
        self.count = 0
        self.lock = threading.Lock()
        with open(self.dir / "server.log", "wb") as log:
            self.proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "cli_server.py"), self.socket],
                                         cwd=self.dir, env=cli_env(self.dir), stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=log)

    def close(self) -> None:
        import shutil

        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _connect(self) -> socket.socket:
        deadline = time.monotonic() + 120
        while True:
            conn = socket.socket(socket.AF_UNIX)
            try:
                conn.connect(self.socket)
                return conn
            except (FileNotFoundError, ConnectionRefusedError):
                conn.close()
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    log = (self.dir / "server.log").read_text()[-2000:]
                    raise RuntimeError(f"cli_server.py did not start: {log}") from None
                time.sleep(0.05)

    def run(self, args: list[str], cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess | None:
        with self.lock:
            self.count += 1
            n = self.count
        out, err = self.dir / f"{n}.out", self.dir / f"{n}.err"
        request = {"args": args, "cwd": str(cwd), "env": env, "stdout": str(out), "stderr": str(err)}
        with self._connect() as conn:
            conn.sendall(json.dumps(request).encode() + b"\n")
            lines = _Lines(conn)
            answer = lines.next(60)
            if "pid" not in answer:  # (the server cannot fork safely: run as a plain subprocess)
                return None
            try:
                code = lines.next(timeout)["code"]
            except BaseException as exc:  # (its own timeout, or pytest-timeout's: no rank outlives the test)
                os.killpg(answer["pid"], signal.SIGKILL)
                for pid in processes_mentioning(str(cwd)):  # its workers: forked from the server, in their own group
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                if not isinstance(exc, TimeoutError):
                    raise
                lines.next(60)
                tail = err.read_text(errors="replace")[-3000:]
                raise AssertionError(f"disttrain {' '.join(args)} ran over {timeout}s; stderr tail:\n{tail}") from None
        texts = []
        for path in (out, err):
            texts.append(path.read_text(errors="replace"))
            path.unlink()
        return subprocess.CompletedProcess(DISTTRAIN + args, code, *texts)


class _Lines:
    """JSON lines from a socket, each within its own timeout."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn, self.buffer = conn, b""

    def next(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            self.conn.settimeout(left)
            chunk = self.conn.recv(65536)  # (TimeoutError past the deadline)
            if not chunk:
                raise RuntimeError("cli_server.py closed the connection (did it die? see its server.log)")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)


_SERVER: list[CliServer] = []
_SERVER_LOCK = threading.Lock()


def harness_processes() -> set[int]:
    """The test harness's own long-lived children, which tests that count children leave out: the CLI server, and
    the forkserver (with its resource tracker) a benchmark launched in this process forks its workers from."""
    import multiprocessing.forkserver
    import multiprocessing.resource_tracker

    servers = {multiprocessing.forkserver._forkserver._forkserver_pid,
               multiprocessing.resource_tracker._resource_tracker._pid}
    return {server.proc.pid for server in _SERVER} | {pid for pid in servers if pid}


def _server() -> CliServer:
    with _SERVER_LOCK:
        if not _SERVER:
            _SERVER.append(CliServer())
            atexit.register(_SERVER[0].close)
        return _SERVER[0]


def run_alongside(command: list[str], cwd: Path, launch: Callable[[], T], timeout: float = 180
                  ) -> tuple[subprocess.CompletedProcess, T]:
    """Run `command` (a one-process job, e.g. the reference) while `launch()` runs (a multi-rank launch), and return
    both results: the one process uses the core time the launch leaves idle (its launcher's start-up, the
    rendezvous, ranks waiting in collectives) instead of a stretch of its own."""
    proc = subprocess.Popen(command, cwd=cwd, env=cli_env(cwd), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        launched = launch()
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(command, proc.returncode, out, err), launched


def free_port() -> int:
    """A free loopback port for a server a test starts later, chosen outside the kernel's ephemeral range: a port
    the kernel hands out (`bind(0)`, or a connection's source port) may be taken by another process between this
    probe and the server's own bind, and a client would then talk to that process instead."""
    import random
    import socket

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(100):
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def processes_mentioning(marker: str) -> list[int]:
    """PIDs (other than ours) whose command line, stdout or stderr mentions `marker`: used to prove nothing was left
    behind. (Workers of `disttrain train` are forked from a forkserver, whose command line they carry: their stdout
    and stderr are their log files in the run folder.)"""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            status = Path(f"/proc/{pid}/status").read_text()
            streams = []
            for fd in (1, 2):
                try:
                    streams.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
                except OSError:
                    pass
        except OSError:
            continue
        mentions = any(marker in text for text in (cmdline, *streams))
        if mentions and int(pid) != os.getpid() and "State:\tZ" not in status:
            found.append(int(pid))
    return found


@pytest.fixture(autouse=True)
def no_process_group_left():
    """A process group a test formed in pytest's own process (a one-rank group: `bench.gpu.kit.runtime(group=True)`) is
    destroyed after it, as `runtime.shutdown` would: a later test's `init_runtime` would take it for the user's."""
    yield
    dist = sys.modules.get("torch.distributed")  # (a test that never imported torch formed no group)
    if dist is not None and dist.is_available() and dist.is_initialized():
        import gc

        gc.collect()  # wrappers in reference cycles (DDP) must die while the group is still registered
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def gpt_parity(tmp_path_factory) -> tuple[dict, dict]:
    """The small GPT job of scripts/strategy_parity.py trained once for the session: the one-process variants
    (references) in one process and the others in one 2-rank launch, for test_parallel_fsdp.py and, where
    DeepSpeed is installed, test_parallel_deepspeed.py (which name them: `ONE_PROCESS`, `LAUNCHED`). The files
    share one torch start-up per rank, and DeepSpeed's. Returns ({variant: run} on 1 process, ... on 2 ranks),
    each run with its final `params` and, on 2 ranks, its `metrics` lines."""
    import importlib.util

    from safetensors.torch import load_file

    import test_parallel_fsdp

    files = [test_parallel_fsdp]
    if importlib.util.find_spec("deepspeed"):
        import test_parallel_deepspeed

        files.append(test_parallel_deepspeed)
    one_process = list(dict.fromkeys(v for f in files for v in f.ONE_PROCESS))
    launched = list(dict.fromkeys(v for f in files for v in f.LAUNCHED))
    tmp = tmp_path_factory.mktemp("strategies")
    script = str(SCRIPTS / "strategy_parity.py")
    steps = ["train.steps=12", "train.eval_every=6"]  # >= 10 steps (the parity bar); half the time of 20
    single, multi = run_alongside(
        [sys.executable, script, str(tmp), *steps, *one_process], tmp,
        lambda: run_cli(["launch", "--fork", "--nproc", "2", "--run-dir", str(tmp / "launch"), script, str(tmp), *steps,
                         *launched], tmp, timeout=500))
    assert single.returncode == 0, single.stderr
    assert multi.returncode == 0, multi.stderr[-3000:]
    # no native op is compiled: the client optimizer is torch's, and the strategy skips DeepSpeed's shm_comm
    assert "shm_comm_op built" not in multi.stdout + multi.stderr  # no ~50 s compile on a machine's first run
    assert "` is deprecated" not in multi.stderr  # (torch's notices of the collectives DeepSpeed calls by old names)
    one, two = json.loads((tmp / "1.json").read_text()), json.loads((tmp / "2.json").read_text())
    for world, runs in ((1, one), (2, two)):
        for variant, run in runs.items():
            run["params"] = load_file(tmp / str(world) / f"{variant}.safetensors")
    for variant, run in two.items():
        run["metrics"] = read_metrics(tmp / variant.replace(":", "_").replace(">", "_to_").replace("@", "_"))
    return one, two


@pytest.fixture
def small_gpt() -> list[str]:
    """Overrides for a GPT small enough for fast multi-process tests, logging every step (tests compare the lines)."""
    return ["--set", "model.n_layer=2", "--set", "model.d_model=64", "--set", "model.n_head=4",
            "--set", "model.seq_len=32", "--set", "log.progress=false", "--set", "train.log_every=1"]


@pytest.fixture
def tiny_disk(tmp_path):
    """A real 1 MiB file system (tmpfs), so a save really hits ENOSPC."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)]).returncode != 0:
        pytest.skip("needs permission to mount a tmpfs (root)")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)
