"""The worker group's life cycle under the service's failure policy: start, fail or restart, status, shutdown.

Failures (`on_failure`): `fail` raises a `WorkerFailure` naming the worker from the call that was
running (or the next one) and the service stays failed; `restart` kills the group, starts a new one,
reloads the checkpoint this service last saved or loaded (the very step: never a newer one left by
another run), and raises
`WorkersRestarted(step)` from the call that was interrupted (or the next call, if the failure was seen
between calls and work since the checkpoint was lost), so the loop can go back to that step; the call
after it proceeds. A restart that loses nothing (no step or micro-batch since the checkpoint) is silent.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import asdict
from typing import Any

from disttrain.errors import ConfigError
from disttrain.service.group import WorkerFailure, WorkerGroup
from disttrain.service.local_launcher import ForkLauncher, LocalLauncher

log = logging.getLogger(__name__)


class WorkersRestarted(RuntimeError):
    """The worker group was restarted after a failure and restored to checkpoint `step` (0: no checkpoint,
    fresh weights); the work since then was lost and the caller should continue from that step."""

    def __init__(self, step: int, cause: WorkerFailure):
        super().__init__(f"workers restarted after: {cause}; restored step {step}")
        self.step, self.cause = step, cause


class GroupLifecycle:
    """The workers behind a `TrainingService` (service.py, which adds the training calls): `_run(action)` runs one
    call under the failure policy; `_start` / `_restart` (re)build the group and set up the model in every worker."""

    def __init__(self, options: Any, setup: dict[str, Any], live: dict[str, Any] | None = None):
        self.options, self._setup = options, setup
        self._live = live or {}  # objects forked workers inherit (as_service(model=...))
        self.group: WorkerGroup | None = None
        self.devices: list[str] = []
        """The device each rank trains on ("cpu", "cuda:0"), as its worker reported it at setup."""
        self.generation = 0
        self.restarts = 0
        self.step = 0
        self._micro_batches = 0  # since the last optim_step
        self._checkpoint: tuple[str, int] | None = None  # (folder, step) of the last save/load: what a restart restores
        self._started = False  # restarts apply to a service that started; a failed start just raises
        self._failed: WorkerFailure | None = None
        self._notice: WorkersRestarted | None = None
        self._restarting: asyncio.Task | None = None
        self._lock = asyncio.Lock()
        self.failures: list[dict[str, Any]] = []

    @property
    def nproc(self) -> int:
        return self.options.nproc


    def _launcher(self):
        if self.options.launcher == "ray":
            from disttrain.service.ray_launcher import RayLauncher

            return RayLauncher(self.options)
        if self._live:
            return ForkLauncher(self._live, self.options.env, self.options.log_dir, gpu=self.options.device != "cpu")
        return LocalLauncher(self.options.env, self.options.log_dir)

    async def _start(self) -> None:
        o = self.options
        group = WorkerGroup(self._launcher(), o.nproc, host=o.host, heartbeat_s=o.heartbeat_s,
                            heartbeat_timeout_s=o.heartbeat_timeout_s, startup_timeout_s=o.startup_timeout_s,
                            progress_timeout_s=o.timeout_s, on_failure=self._on_failure)
        await group.start()
        self.group = group
        threads = o.threads_per_rank or (1 if o.launcher == "ray" else max(1, (os.cpu_count() or 1) // o.nproc))
        try:
            gpus = getattr(group.launcher, "gpus", None) or [[] for _ in range(o.nproc)]  # Ray's, per worker
            messages = [({**self._setup, "store_host": o.host, "store_port": group.store.port,
                          "generation": self.generation, "threads": threads, "local_rank": local_rank,
                          "local_world_size": local_world, "gpu_bound": bool(ids)}, None)
                        for (local_rank, local_world), ids in zip(_local_ranks(group.launcher, o.nproc,
                                                                               o.device != "cpu"), gpus, strict=True)]
            replies = await group.all(messages)
        except BaseException:
            await group.close(graceful=False)
            raise
        self.devices = [reply["device"] for reply, _ in replies]

    def _on_failure(self, failure: WorkerFailure) -> None:
        self.failures.append({"time": time.time(), "error": str(failure), "rank": failure.rank,
                              "generation": self.generation})
        if self.options.on_failure == "restart" and self._restarting is None and self._started:
            self._restarting = asyncio.get_running_loop().create_task(self._restart(failure))

    async def _restart(self, failure: WorkerFailure) -> None:
        """Kill the group, start a new one, reload the newest checkpoint."""
        try:
            if self.restarts >= self.options.max_restarts:
                raise WorkerFailure(f"{failure}; giving up after {self.restarts} restarts "
                                    f"(max_restarts = {self.options.max_restarts})", failure.rank)
            lost = self._micro_batches > 0 or self.step != (self._checkpoint[1] if self._checkpoint else 0)
            await self.group.close(graceful=False)
            self.restarts += 1
            self.generation += 1
            log.warning("restarting the worker group (restart %d): %s", self.restarts, failure)
            await self._start()
            restored = await self._load(*self._checkpoint) if self._checkpoint else 0
            self.step, self._micro_batches = restored, 0
            if lost:
                self._notice = WorkersRestarted(restored, failure)
        except (asyncio.CancelledError, KeyboardInterrupt, SystemExit):
            await self.group.close(graceful=False)
            raise
        except BaseException as exc:
            self._failed = exc if isinstance(exc, WorkerFailure) else WorkerFailure(f"{failure}; restart failed: {exc}")
            await self.group.close(graceful=False)  # giving up: no process is left behind
        finally:
            self._restarting = None

    async def _run(self, action):
        """Run one public call under the failure policy."""
        if self.group is None:
            raise RuntimeError("the TrainingService is shut down")
        async with self._lock:
            await self._settle()
            try:
                return await action()
            except WorkerFailure as failure:
                if self.options.on_failure == "fail":
                    self._failed = self._failed or failure
                    await self.group.close(graceful=False)
                    raise self._failed from None
                while self._restarting is not None:  # the call was interrupted: always say so
                    await asyncio.shield(self._restarting)
                if self._failed is not None:
                    raise self._failed from None
                notice, self._notice = self._notice or WorkersRestarted(self.step, failure), None
                raise notice from None

    async def _settle(self) -> None:
        """Wait for a restart in progress; raise a failure or a pending restart notice."""
        while self._restarting is not None:
            await asyncio.shield(self._restarting)
        if self._failed is not None:
            raise self._failed
        if self.group.failure is not None and self.options.on_failure == "fail":
            self._failed = self.group.failure
            await self.group.close(graceful=False)
            raise self._failed
        if self._notice is not None:
            notice, self._notice = self._notice, None
            raise notice

    async def _every_rank(self, message: dict[str, Any]) -> list[tuple[dict, dict]]:
        """The same command (no tensors) on every rank; their replies in rank order."""
        return await self.group.all([(message, None)] * self.nproc)

    async def _load(self, folder: str, step: int | str) -> int:
        message = {"op": "load", "path": folder, "step": step, "timeout_s": self.options.timeout_s}
        replies = await self._every_rank(message)
        return int(replies[0][0]["step"])

    async def status(self) -> dict[str, Any]:
        """Health of every worker, restarts, failures, and the step (never raises for a failed group)."""
        state = "failed" if self._failed else ("restarting" if self._restarting else (
            "degraded" if self.group is not None and self.group.failure else "healthy"))
        return {"state": state, "launcher": self.options.launcher, "nproc": self.nproc, "step": self.step,
                "generation": self.generation, "restarts": self.restarts, "failures": list(self.failures),
                "workers": self.group.status() if self.group is not None else [], "devices": self.devices,
                "checkpoint": self._checkpoint[0] if self._checkpoint else None,
                "options": {**asdict(self.options), "env": dict.fromkeys(self.options.env, "<set>")}}

    async def shutdown(self) -> None:
        """Stop every worker (leaving the process group cleanly when the group is healthy)."""
        while self._restarting is not None:
            await asyncio.shield(self._restarting)
        if self.group is not None:
            await self.group.close(graceful=self.group.failure is None and self._failed is None)
            self.group = None
            self.devices = []

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()


def _local_ranks(launcher, procs: int, gpu_ranks: bool = True) -> list[tuple[int, int]]:
    """(local rank, ranks on its node) of each rank, as torchrun would set them: all on this machine for the local
    launchers; under Ray by the node each actor landed on, with local rank 0 for an actor Ray gave GPUs (it sees only
    those), as `launch_ray` does. ConfigError (one line) where Ray gave two ranks of a node the same GPU (fractional
    `gpus_per_worker`) and they would train on it (`gpu_ranks`: any device but "cpu"): two nccl ranks cannot share
    one."""
    nodes = getattr(launcher, "nodes", None)
    if not nodes:
        return [(rank, procs) for rank in range(procs)]
    gpus = getattr(launcher, "gpus", None) or [[] for _ in nodes]
    seen: dict[tuple[str, str], int] = {}
    for rank, (node, ids) in enumerate(zip(nodes, gpus, strict=True)):
        for gpu in ids if gpu_ranks else ():
            if (node, gpu) in seen:
                raise ConfigError(f"gpus_per_worker: Ray put ranks {seen[node, gpu]} and {rank} on GPU {gpu} of one "
                                  "node, and two ranks cannot share a GPU (nccl refuses); give each rank a whole GPU "
                                  "(gpus_per_worker = 1), or one rank (nproc = 1)")
            seen[node, gpu] = rank
    from disttrain.service.ray_launcher import local_ranks

    return local_ranks(nodes, gpus)
