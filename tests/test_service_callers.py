"""The TrainingService for any caller (service/callers.py): a plain script (`as_blocking_service`) and trio
(`as_anyio_service`), each with the single-process reference's losses; errors come back to the caller as the
service raises them; nothing is left running after shutdown. asyncio's own callers: test_service.py."""

import os
import signal
import sys
import threading
from pathlib import Path

import pytest
import torch

from conftest import processes_mentioning
from disttrain.service import AnyioService, BlockingService, RemoteError, TrainingService, WorkerFailure

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import service_job as job  # noqa: E402

STEPS = 10
SETUP = {"model_args": job.MODEL, "optimizer": job.OPTIM, "strategy": "ddp", "seed": job.SEED}


@pytest.fixture(scope="module")
def reference() -> list[float]:
    torch.set_num_threads(1)
    return job.reference(STEPS)


def assert_close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-5, (got, want)


def test_a_plain_script_gets_the_reference_losses_and_errors_as_raised(reference):
    service = TrainingService.options(nproc=2, threads_per_rank=1).as_blocking_service("gpt", **SETUP)
    assert isinstance(service, BlockingService)
    with service:
        losses = []
        for batch in job.batches(STEPS):
            service.forward_backward(batch)
            losses.append(service.optim_step()["loss"])
        assert_close(losses, reference)
        with pytest.raises(RemoteError, match="no_such_function"):
            service.call("tests_do_not_have:no_such_function")
        assert service.status()["step"] == STEPS  # still usable after the error
        service.shutdown()  # (and again on leaving the with block: a no-op)
        with pytest.raises(RuntimeError, match="status: this service was shut down"):
            service.status()
    assert not processes_mentioning("disttrain.service.worker --connect")
    assert not [t for t in threading.enumerate() if t.name == "disttrain-service"]  # the loop's thread ended


def test_trio_caller_gets_the_reference_losses_and_sees_a_killed_worker(reference):
    trio = pytest.importorskip("trio")

    async def main() -> tuple[list[float], str]:
        service = await TrainingService.options(nproc=2, threads_per_rank=1).as_anyio_service("gpt", **SETUP)
        assert isinstance(service, AnyioService)
        async with service:
            losses = []
            for batch in job.batches(STEPS):
                await service.forward_backward(batch)
                losses.append((await service.optim_step())["loss"])
            victim = (await service.status())["workers"][1]["pid"]
            os.kill(victim, signal.SIGKILL)
            await trio.sleep(1.0)
            with pytest.raises(WorkerFailure) as failure:
                await service.forward_backward(next(job.batches(1)))
        return losses, str(failure.value)

    losses, failure = trio.run(main)
    assert_close(losses, reference)
    assert "worker 1" in failure or "rank 1" in failure, failure
    assert not processes_mentioning("disttrain.service.worker --connect")
