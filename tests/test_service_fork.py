"""The forked worker tier (service/fork.py) and the TrainingService given live objects: workers inherit the
driver's model, optimizer and loss function (no serialisation) and train like the import-path form; forking is
refused in one line where it is unsafe."""

import asyncio
import os
import sys
import threading
from pathlib import Path

import pytest
import torch
from tqdm.auto import tqdm

from disttrain.config import ModelConfig, OptimConfig
from disttrain.losses import lm_loss
from disttrain.models.gpt import GPT
from disttrain.optim import optimizer_factory
from disttrain.service import ForkUnsafe, TrainingService, Worker, spawn_training_workers
from disttrain.service.fork import fork_problem

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import service_job as job  # noqa: E402

STEPS = 10


@pytest.fixture(autouse=True)
def no_other_threads():
    """Forking needs a driver without other threads: let those of earlier tests end (trio's and anyio's worker
    threads idle for some seconds before they exit)."""
    for _ in range(300):
        if fork_problem() is None:
            return
        threading.Event().wait(0.1)
    pytest.fail(f"threads of earlier tests still run: {[t.name for t in threading.enumerate()]}")


def test_forked_workers_inherit_objects_and_talk_in_frames():
    weights = torch.arange(6.0)  # built here, never sent: the children read their inherited copy

    def work(conn, rank, world):
        message, tensors = conn.recv()
        conn.send({"rank": rank, "world": world, "echo": message["n"]}, {"y": tensors["x"] * 2 + weights})

    list(tqdm(range(2), disable=False))  # a progress bar's monitor thread (transformers' loading) does not block it
    workers = spawn_training_workers(2, work)
    for w in workers:
        w.send({"n": 7}, {"x": torch.ones(6)})
    replies = [w.recv() for w in workers]
    assert [m for m, _ in replies] == [{"rank": 0, "world": 2, "echo": 7}, {"rank": 1, "world": 2, "echo": 7}]
    assert all(torch.equal(t["y"], torch.arange(6.0) + 2) for _, t in replies)
    assert [w.wait() for w in workers] == [0, 0]

    failing = Worker(lambda conn: 1 / 0)
    with pytest.raises(EOFError):  # it closed its end by exiting
        failing.recv()
    assert failing.wait() == 1


def test_forking_with_another_thread_running_is_refused_in_one_line():
    release = threading.Event()
    other = threading.Thread(target=release.wait, name="busy")
    other.start()
    try:
        with pytest.raises(ForkUnsafe, match="1 other thread.*busy.*pass import paths instead"):
            Worker(lambda conn: 0)
        with pytest.raises(ForkUnsafe, match=r"as_service\(model=.*cannot fork workers"):
            asyncio.run(TrainingService.options(nproc=2).as_service(model=torch.nn.Linear(2, 2)))
    finally:
        release.set()
        other.join()


def test_live_objects_need_the_local_launcher():
    with pytest.raises(Exception, match="'ray' launcher cannot do; pass import paths"):
        asyncio.run(TrainingService.options(nproc=2, launcher="ray").as_service(model=torch.nn.Linear(2, 2)))


def test_live_model_optimizer_and_loss_match_the_import_path_reference():
    torch.set_num_threads(1)
    reference = job.reference(STEPS)
    torch.manual_seed(job.SEED)
    model = GPT(ModelConfig(**job.MODEL))  # as the workers would build it from "gpt" and the seed
    optimizer = optimizer_factory(OptimConfig(**job.OPTIM))(model)  # its parameter groups travel by name

    async def main() -> tuple[list[float], list[int]]:
        service = await TrainingService.options(nproc=2, threads_per_rank=1).as_service(
            model=model, optimizer=optimizer, loss_fn=lm_loss, strategy="fsdp", seed=job.SEED,
            grad_clip=job.OPTIM["grad_clip"])
        async with service:
            losses = []
            for batch in job.batches(STEPS):
                await service.forward_backward(batch)
                losses.append((await service.optim_step())["loss"])
            return losses, [w["pid"] for w in (await service.status())["workers"]]

    losses, pids = asyncio.run(main())
    assert max(abs(a - b) for a, b in zip(losses, reference, strict=True)) < 1e-5, (losses, reference)
    assert all(pid != os.getpid() and not Path(f"/proc/{pid}").exists() for pid in pids)  # forked, then reaped
