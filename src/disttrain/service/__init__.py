"""Immediate-mode training as a service: `TrainingService` over local worker processes or Ray actors.

Two tiers: `worker.py` + `group.py` (spawn workers, send them commands; usable on their own) and
`service.py` (the convenient async API with health monitoring and a failure policy). `wire.py` is the
message format (JSON + safetensors; never pickle).
"""

from disttrain.service.callers import AnyioService, BlockingService
from disttrain.service.group import RemoteError, WorkerFailure, WorkerGroup
from disttrain.service.local_launcher import LocalLauncher
from disttrain.service.service import ServiceOptions, TrainingService, WorkersRestarted
from disttrain.service.wire import split_batch

__all__ = ["AnyioService", "BlockingService", "LocalLauncher", "RemoteError", "ServiceOptions", "TrainingService",
           "WorkerFailure", "WorkerGroup",
           "WorkersRestarted", "split_batch"]
