"""Immediate-mode training as a service: `TrainingService` over local worker processes or Ray actors.

Two tiers: `fork.py` (`Worker(work_fn)`, `spawn_training_workers(n, work_fn)`: forked processes with send/recv),
`worker.py` + `group.py` (the ranks the service drives, spawned or forked; usable on their own) and
`service.py` (the convenient async API with health monitoring and a failure policy). `wire.py` is the
message format (JSON + safetensors; never pickle).
"""

from disttrain.service.callers import AnyioService, BlockingService
from disttrain.service.fork import ForkUnsafe, Worker, spawn_training_workers
from disttrain.service.group import RemoteError, WorkerFailure, WorkerGroup
from disttrain.service.local_launcher import LocalLauncher
from disttrain.service.service import ServiceOptions, TrainingService, WorkersRestarted
from disttrain.service.wire import split_batch

__all__ = ["AnyioService", "BlockingService", "ForkUnsafe", "LocalLauncher", "RemoteError", "ServiceOptions",
           "TrainingService", "Worker", "WorkerFailure", "WorkerGroup", "WorkersRestarted", "spawn_training_workers",
           "split_batch"]
