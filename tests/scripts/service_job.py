"""The job the TrainingService tests train: a small GPT on the built-in language, its global batches
(the sampler's order) and a single-process reference built from the same pieces.

    python service_job.py reference OUT.json STEPS    # per-step losses of one process, no service
"""

import json
import sys

import torch

from disttrain.backend import create_backend
from disttrain.config import DataConfig, ModelConfig, OptimConfig, ParallelConfig
from disttrain.data import GlobalSampler, build_datasets, fetch
from disttrain.models.gpt import GPT
from disttrain.optim import optimizer_factory

MODEL = {"n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 16}
OPTIM = {"lr": 3e-3, "warmup_steps": 0, "grad_clip": 1.0}
GLOBAL_BATCH = 8
SEED = 0


def batches(steps: int, start: int = 0):
    """The global batches of steps start+1..steps, in the order `disttrain train` reads them."""
    train, _ = build_datasets(DataConfig(), MODEL["seq_len"])
    sampler = GlobalSampler(len(train), SEED)
    for step in range(start, steps):
        yield fetch(train, sampler.rank_indices(step * GLOBAL_BATCH, GLOBAL_BATCH, 1, 0))


def plain(steps: int):
    """The independent plain-torch loop (plain_reference.py) on this job: losses, grad norms, final parameters."""
    import plain_reference

    from disttrain.data import synthetic_corpus

    optim, data = OptimConfig(**OPTIM), DataConfig()
    tokens = synthetic_corpus()
    windows = plain_reference.windows(tokens[:int(len(tokens) * (1.0 - data.val_fraction))], MODEL["seq_len"])
    torch.manual_seed(SEED)
    model = GPT(ModelConfig(**MODEL))
    return plain_reference.train(model, windows, seed=SEED, global_batch=GLOBAL_BATCH, steps=steps, optim=optim.name,
                                 lr=optim.lr, weight_decay=optim.weight_decay, betas=(optim.beta1, optim.beta2),
                                 grad_clip=optim.grad_clip)  # the service runs no schedule unless given total_steps


def reference(steps: int) -> list[float]:
    torch.manual_seed(SEED)
    model = GPT(ModelConfig(**MODEL))
    backend = create_backend(model, optimizer_factory(OptimConfig(**OPTIM)), ParallelConfig(strategy="single"),
                             grad_clip=OPTIM["grad_clip"])
    losses = []
    for batch in batches(steps):
        backend.forward_backward(batch)
        losses.append(backend.optim_step()["loss"])
    return losses


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1] == "reference":
        with open(sys.argv[2], "w") as f:
            json.dump(reference(int(sys.argv[3])), f)


def collective_checks(batch, offset: float = 0.0):
    """Run on every rank by `service.call`: the distributed utilities on this rank's slice."""
    import torch.distributed as dist

    from disttrain import collectives

    rank = dist.get_rank()
    collectives.barrier()
    ragged = torch.arange(rank + 1, dtype=torch.float32) + 10 * rank  # rank r holds r+1 values
    return {
        "whitened": collectives.whiten(batch["advantages"]),
        "gathered": torch.cat(collectives.gather_variable(ragged)),
        "mean": collectives.all_reduce_metrics({"x": float(rank) + offset})["x"],
        "sum": collectives.all_reduce_metrics({"x": float(rank)}, op="sum")["x"],
        "json": collectives.gather_json({"rank": rank}),
    }


def mean_loss(logits, batch):
    """A custom loss returning a mean (the backend weights it by the batch size)."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())


def rows(batch):
    """`service.call` target: the rows this rank received."""
    return len(batch["x"])


def compiled_graphs(batch) -> int:
    """`service.call` target: the graphs torch.compile made in this worker (0: its blocks ran eagerly)."""
    import torch._dynamo

    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def dying_model():
    """A model factory that kills its process on rank $SERVICE_JOB_DIE_RANK (a worker dying during setup)."""
    import os

    import torch.distributed as dist

    if str(dist.get_rank()) == os.environ.get("SERVICE_JOB_DIE_RANK"):
        os._exit(9)
    return torch.nn.Linear(2, 2)


def sleep(batch, seconds: float):
    """`service.call` target: a worker busy in a long command."""
    import time

    time.sleep(seconds)


def stalling_loss(logits, batch):
    """A loss that never returns on rank 1 (a hang in the user's code, mid-forward): its peers go on into the
    backward and wait for it in the gradients' all-reduce."""
    import time

    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(600)
    return mean_loss(logits, batch)
