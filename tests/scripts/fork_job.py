"""A driver process of its own for the forked-worker tests (a pytest process has usually started torch's CPU thread
pool already, which rightly refuses forking). `python fork_job.py MODE` prints one JSON line:

    workers  spawn_training_workers: children inherit a tensor and answer in frames; a raising child exits 1
    live     fsdp on 2 forked workers given a live GPT, AdamW and loss function: losses and the workers' pids
    native   a driver that ran a 2-thread matmul first: the refusal's message
"""

import asyncio
import json
import sys

import torch


def workers() -> dict:
    from tqdm.auto import tqdm

    from disttrain.service import Worker, spawn_training_workers

    weights = torch.arange(6.0)  # built here, never sent: the children read their inherited copy

    def work(conn, rank, world):
        message, tensors = conn.recv()
        conn.send({"rank": rank, "world": world, "echo": message["n"]}, {"y": tensors["x"] * 2 + weights})
        return "done"  # not an int: the child still exits 0

    list(tqdm(range(2), disable=False))  # a progress bar's monitor thread (transformers' loading) does not block it
    forked = spawn_training_workers(2, work)
    for w in forked:
        w.send({"n": 7}, {"x": torch.ones(6)})
    replies = [w.recv() for w in forked]
    failing = Worker(lambda conn: 1 / 0)
    try:
        failing.recv()
        closed = False
    except EOFError:  # it closed its end by exiting
        closed = True
    return {"messages": [m for m, _ in replies], "y": [t["y"].tolist() for _, t in replies],
            "codes": [w.wait() for w in forked], "failing": [closed, failing.wait()]}


def live() -> dict:
    import service_job as job

    from disttrain.config import ModelConfig, OptimConfig
    from disttrain.losses import lm_loss
    from disttrain.models.gpt import GPT
    from disttrain.optim import optimizer_factory
    from disttrain.service import TrainingService

    steps = int(sys.argv[2])
    torch.manual_seed(job.SEED)
    model = GPT(ModelConfig(**job.MODEL))  # as the workers would build it from "gpt" and the seed
    optimizer = optimizer_factory(OptimConfig(**job.OPTIM))(model)  # its parameter groups travel by name

    async def main() -> dict:
        service = await TrainingService.options(nproc=2, threads_per_rank=2).as_service(
            model=model, optimizer=optimizer, loss_fn=lm_loss, strategy="fsdp", seed=job.SEED,
            grad_clip=job.OPTIM["grad_clip"])
        async with service:
            losses = []
            for batch in job.batches(steps):
                await service.forward_backward(batch)
                losses.append((await service.optim_step())["loss"])
            families = [h.writer.get_extra_info("socket").family.name for h in service.group.workers.values()]
            return {"losses": losses, "pids": [w["pid"] for w in (await service.status())["workers"]],
                    "families": families}

    return asyncio.run(main())


def native() -> dict:
    from disttrain.service import ForkUnsafe, Worker

    torch.set_num_threads(2)
    torch.randn(512, 512) @ torch.randn(512, 512)  # starts torch's OpenMP pool
    try:
        Worker(lambda conn: 0)
    except ForkUnsafe as exc:
        return {"refused": str(exc)}
    return {"refused": None}


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps({"workers": workers, "live": live, "native": native}[sys.argv[1]]()))
