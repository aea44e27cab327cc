"""The tests' `disttrain` commands, forked from one process that imported torch and the CLI once.

Started as `python cli_server.py SOCKET` by `conftest.run_cli`. A fresh `python -m disttrain ...` spends about two
seconds of CPU importing torch (and the modules its command needs) before it reads its arguments, and the suite
runs a few hundred commands. This server imports `PRELOAD` once and forks one child per command; the child becomes
that command's process as `python -m disttrain` would start it:

- its own session (the test kills the process group on a timeout), the test's environment, working folder,
  `sys.path` (folder first, then PYTHONPATH) and temp folder, stdin from /dev/null, stdout/stderr into files;
- `disttrain.cli.main()` with `sys.argv`; it ends as the real command does (`exit_process` for commands that used
  torch.distributed); a `SystemExit` (argparse, `sys.exit`) ends it as the interpreter would, non-daemon threads
  joined and atexit handlers run, but without the module teardown, which takes ~1.4 s once torch is imported.

The server never runs a torch operation (forked children would inherit a used OpenMP pool) and checks that it has
one thread before each fork. Protocol, one connection per command: the client sends one JSON line {args, cwd, env,
stdout, stderr}; the server answers {"pid": P} once forked and {"code": C} when the child ends (C as
`subprocess` reports it: negative for a signal). It exits when its parent (the pytest process) is gone.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import socket
import sys
import threading
import traceback

from disttrain import launch_fork

PRELOAD = (*launch_fork.PRELOAD, "torch.distributed.run", "torch.distributed.checkpoint", "disttrain.cli.main",
           "disttrain.launch")
"""What a command imports before it reads its arguments: what its workers import (launch_fork.py), and the CLI."""


def serve(path: str) -> dict:
    """Fork a child per request; return only in a child, with its request."""
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(64)
    waiting: dict[int, socket.socket] = {}
    while os.getppid() == parent:
        ready, _, _ = select.select([listener], [], [], 0.05)
        if ready:
            conn, _ = listener.accept()
            request = json.loads(conn.makefile("rb").readline())
            if threading.active_count() != 1 or len(os.listdir("/proc/self/task")) != 1:
                conn.sendall(b'{"error": "the server has threads: forking it is unsafe"}\n')
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in (conn, *waiting.values()):
                    other.close()
                return request
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            waiting[pid] = conn
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if not pid:
                break
            conn = waiting.pop(pid, None)
            if conn is None:  # (the forkserver or multiprocessing's resource tracker, also children of this server)
                continue
            try:
                conn.sendall(json.dumps({"code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            except OSError:  # the test gave up on it
                pass
            conn.close()
    os._exit(0)


def become(request: dict) -> None:
    """Turn this forked child into `python -m disttrain ARGS` as the request describes, and run it."""
    import importlib
    import tempfile

    os.setsid()
    share_forkserver()
    launch_fork.enter(request["env"], request["cwd"])
    tempfile.tempdir = None  # (read again from TMPDIR)
    importlib.invalidate_caches()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        target = os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    os.close(null)
    import disttrain
    from disttrain.cli.main import main

    sys.argv = [os.path.join(os.path.dirname(disttrain.__file__), "__main__.py"), *request["args"]]  # as `-m` sets it
    try:
        main()
        code = 0
    except SystemExit as exc:  # (`--help`, argparse's errors, ... end a real process by this exception too)
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 (as the interpreter would: the traceback and exit code 1)
        traceback.print_exc()
        code = 1
    # the interpreter's exit without tearing down torch's modules (~1.4 s): threads joined, atexit run, flushed
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def start_forkserver() -> None:
    """Start the forkserver `disttrain train` forks its workers from (launch_fork.py) once, for every command.

    A child of this server finds it already running (multiprocessing's `ensure_running` would ask `waitpid` about a
    process that is not the child's own, and fail): its check is replaced by one that only checks that the server
    is alive. The workers of every command are then forked from one preloaded process."""
    import multiprocessing.forkserver
    import tempfile

    multiprocessing.get_context("forkserver").set_forkserver_preload(list(launch_fork.PRELOAD))
    tempfile.tempdir = os.path.dirname(sys.argv[1])  # (its socket: a short path)
    multiprocessing.forkserver.ensure_running()
    tempfile.tempdir = None


def share_forkserver() -> None:
    """In a command's process: use the server's forkserver (see `start_forkserver`)."""
    import multiprocessing.forkserver
    from multiprocessing import resource_tracker

    server = multiprocessing.forkserver._forkserver
    pid = server._forkserver_pid

    def ensure_running() -> None:
        resource_tracker.ensure_running()
        os.kill(pid, 0)  # (raises if it died: the test fails loudly rather than hangs)

    server.ensure_running = multiprocessing.forkserver.ensure_running = ensure_running


if __name__ == "__main__":
    for name in PRELOAD:
        __import__(name)
    start_forkserver()
    become(serve(sys.argv[1]))
