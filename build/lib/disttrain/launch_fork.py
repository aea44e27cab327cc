"""disttrain's own workers forked from a server that imported torch and disttrain once.

A worker started as `python -m disttrain.run` spends about 3 s of CPU importing torch and `torch._dynamo` (which
`torch.optim.Optimizer` pulls in on first use) before it trains. Here torchrun's own configuration
(`torch.distributed.run.config_from_args`: rendezvous, restarts, log files) runs a function entrypoint with
multiprocessing's forkserver start method: the server imports `PRELOAD` once and forks each worker from it, and
later launches from the same process (tests, notebooks, a benchmark's sweep) fork from the same server. The entries
forked are disttrain's own modules (`FORKED`): `disttrain train`'s workers, the benchmarks' and `verify`'s.

Two rules make a function entrypoint behave like the subprocess one:
- the worker *returns* (raising SystemExit for an error code): torch's agent waits for every child's return
  value, so a child leaving through `os._exit(0)` would leave it polling for ever; in a forked rank `os._exit(0)`
  on the main thread (`runtime.exit_process` ends that way) raises SystemExit(0) (`_exit_returning`), and
  multiprocessing's own child exit is already `os._exit`, so the gloo teardown race `exit_process` avoids does not
  arise;
- the worker takes the launcher's environment and working folder at this launch (the server's are those of its
  start), with the variables torch's agent set for this rank on top.

Also as for a subprocess rank: its own session (a terminal's Ctrl-C reaches the agent only), the traceback of an
uncaught exception in its output, and, for a script, its `atexit` handlers when it ends.

A user's script or module under `disttrain launch` is forked only when asked (`--fork`): torch is imported before
the script runs, so variables the script sets for torch before importing it (CUDA_VISIBLE_DEVICES, ...) come too
late, and `os._exit(0)` raises SystemExit there (`finally` blocks run).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import sys
import tempfile
import threading
import traceback
from typing import Any

PRELOAD = ("torch", "torch._dynamo", "disttrain.trainer", "disttrain.parallel.ddp", "disttrain.parallel.fsdp")
AGENT_VARIABLES = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
                   "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                   "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS")
"""What torch's LocalElasticAgent sets for each worker (with TORCHELASTIC_*), per its documentation."""
FORKED = ("disttrain.run", "disttrain.cli.verify", "disttrain.bench.")
"""The module entries forked: each has `main(argv)` and ends through its return or `runtime.exit_process`."""


def forks(entry: str, module: bool) -> bool:
    """Whether `launch`'s entry (`module`: run as `python -m`) is one of disttrain's own workers, forked here."""
    return module and any(entry == m or (m.endswith(".") and entry.startswith(m)) for m in FORKED)


def run_forked(args: Any) -> None:
    """torchrun's `run(args)` (`args.training_script` the script or, with `args.module`, the module;
    `args.training_script_args` its arguments), the workers forked."""
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args

    if args.master_port is None:  # as torch.distributed.run.run does (unused by the c10d rendezvous)
        args.master_port = 29500
    config, _, _ = config_from_args(args)
    config.start_method = "forkserver"
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOAD))
    # the server listens on a socket in the temp folder: the caller's, not the run's (launch.py points tempfile at
    # RUN_DIR/tmp, which can be deeper than an AF_UNIX path may be)
    saved, tempfile.tempdir = tempfile.tempdir, None
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        tempfile.tempdir = saved
    agent_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    agent_log.addFilter(_one_line_failures)
    try:
        elastic_launch(config, worker)(dict(os.environ), os.getcwd(), args.training_script, args.module,
                                       *args.training_script_args)
    finally:
        agent_log.removeFilter(_one_line_failures)


def _one_line_failures(record: logging.LogRecord) -> bool:
    """torch's agent logs a failed function entrypoint with the traceback of its own join (a
    `ProcessExitedException`), where a failed subprocess gets one line; keep the line, as for a subprocess (the
    rank's own error is in its output and the failure summary)."""
    if record.exc_info and str(record.msg).startswith("failed (exitcode"):
        record.exc_info = record.exc_text = None
    return True


def enter(environ: dict[str, str], cwd: str) -> None:
    """Make this forked process one started in `cwd` with `environ`: that environment, folder and the import path
    `python -m` would give it there (the folder, then PYTHONPATH, then the interpreter's own)."""
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    extra = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [cwd, *extra, *[p for p in sys.path[1:] if p not in extra]]


_EXIT = os._exit
_RANK = [0]
"""The pid of this forked rank (0 elsewhere): `_exit_returning` acts in it only, not in processes it forks."""


def _exit_returning(code: int) -> None:
    """`os._exit` while a forked rank runs its entry. torch's agent waits for each rank's return value, and a rank
    that left with code 0 and no return would keep it waiting for ever: on the main thread code 0 raises
    SystemExit(0) (the worker then returns, and multiprocessing leaves with the real `os._exit`); from another
    thread, where no return can be made, it becomes code 1 with a line saying why. Other codes, and any process the
    rank forked (a data loader's workers), leave at once."""
    if code != 0 or os.getpid() != _RANK[0]:
        _EXIT(code)
    if threading.current_thread() is threading.main_thread():
        raise SystemExit(0)
    print("disttrain: os._exit(0) from a thread other than the main one cannot return a forked rank to torch's agent: "
          "this rank ends with code 1", file=sys.stderr, flush=True)
    _EXIT(1)


def worker(environ: dict[str, str], cwd: str, entry: str, module: bool, *argv: str) -> None:
    """One rank: the launcher's environment, folder and import path, then `entry` in this process as
    `python [-m] entry argv` would run it (disttrain's own modules through their `main(argv)`)."""
    import torch

    with contextlib.suppress(OSError):  # its own session, as torchrun starts a subprocess rank: a terminal's
        os.setsid()  # Ctrl-C reaches the agent, which forwards one signal, not every rank directly as well
    agent = {k: v for k, v in os.environ.items() if k in AGENT_VARIABLES or k.startswith("TORCHELASTIC_")}
    enter({**environ, **agent}, cwd)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # read at torch's import, which was the server's
        torch.set_num_threads(int(threads))
    # the forkserver exits once no launcher holds its "alive" pipe: a worker must not keep it open, so that the
    # launcher's death (SIGKILL) ends the server and changes the worker's parent, which monitor.py watches
    alive = getattr(multiprocessing.forkserver._forkserver, "_forkserver_alive_fd", None)
    if alive is not None:
        os.close(alive)
        multiprocessing.forkserver._forkserver._forkserver_alive_fd = None
    for stream in (sys.stdout, sys.stderr):  # its files are read live (console.py), as `python -u` writes them
        stream.reconfigure(line_buffering=True)
    code = _run_entry(entry, module, list(argv))
    if code:
        raise SystemExit(code)


def _run_entry(entry: str, module: bool, argv: list[str]) -> int | str | None:
    """Run `entry` as `python [-m] entry argv` would (disttrain's own modules through `main(argv)`), with
    `_exit_returning` in place of `os._exit` meanwhile; its exit code."""
    own = forks(entry, module)
    if not own:  # a script's exit handlers run when it ends, as in `python script.py` (not the server's)
        atexit._clear()
    sys.argv = [entry, *argv]
    _RANK[0], os._exit = os.getpid(), _exit_returning
    try:
        if own:
            return importlib.import_module(entry).main(argv)
        if module:
            runpy.run_module(entry, run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(entry)  # `python script.py` gives __file__ absolute, its folder first
            sys.path[0] = os.path.dirname(script)
            runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as stop:  # sys.exit, argparse, os._exit(0) (runtime.exit_process)
        return stop.code
    except KeyboardInterrupt:  # torch's wrapper would swallow it and post no return value: the agent would wait
        return 130
    except Exception:  # the rank's output gets the traceback, as a started process's stderr would
        traceback.print_exc()
        raise
    finally:
        os._exit = _EXIT  # multiprocessing ends this process with it
        if not own:
            atexit._run_exitfuncs()
