"""`create_backend` with a strategy that needs a process group, in a script started by torchrun with one process:
the backend forms the group itself (world size 1) and trains. Prints what it built as JSON."""

import json

import torch
from torch.nn.parallel import DistributedDataParallel

from disttrain import ParallelConfig, create_backend
from disttrain.runtime import exit_process, shutdown

model = torch.nn.Linear(4, 1)
backend = create_backend(model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), ParallelConfig(strategy="ddp"),
                         loss_fn=lambda out, batch: torch.nn.functional.mse_loss(out, batch[1]))
x, y = torch.ones(8, 4), torch.zeros(8, 1)
first = backend.forward_backward((x, y))["loss"]
backend.optim_step()
second = backend.forward_backward((x, y))["loss"]
print(json.dumps({"ddp": isinstance(backend.prepared.module, DistributedDataParallel),
                  "world": backend.runtime.world_size, "distributed": backend.runtime.distributed,
                  "first": first, "second": second}))
shutdown(backend.runtime)
exit_process(0)
