"""TrainingService on Ray: actors in a placement group form the process group; parity, restart after a
SIGKILL, and placement over two Ray nodes started with `ray start` on loopback. Ray's files stay in a
temporary folder; token auth stays on, with a token in the environment rather than in ~/.ray."""

import asyncio
import os
import secrets
import signal
import subprocess
import sys
import tempfile

import pytest

ray = pytest.importorskip("ray")

from conftest import free_port  # noqa: E402
from disttrain.service import TrainingService, WorkersRestarted  # noqa: E402
from test_service import STEPS, assert_close, job, train  # noqa: E402

RAY = os.path.join(os.path.dirname(sys.executable), "ray")


@pytest.fixture(scope="module")
def reference() -> list[float]:
    return job.reference(STEPS)


@pytest.fixture(scope="module")
def ray_env():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_AUTH_TOKEN", secrets.token_hex(32))
        patch.setenv("RAY_USAGE_STATS_ENABLED", "0")
        with tempfile.TemporaryDirectory(prefix="dtray", dir="/tmp") as tmp:  # short: Ray's socket paths must fit
            yield tmp


@pytest.fixture(scope="module")
def local_ray(ray_env):
    # one logical GPU (no device behind it): enough to test placement with fractional GPUs
    ray.init(num_cpus=2, num_gpus=1, resources={"inference": 1}, include_dashboard=False, _temp_dir=ray_env,
             configure_logging=False)
    yield
    ray.shutdown()


async def start(strategy, **options):
    return await TrainingService.options(nproc=2, launcher="ray", **options).as_service(
        "gpt", model_args=job.MODEL, optimizer=job.OPTIM, strategy=strategy, seed=job.SEED)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_ray_service_matches_reference(local_ray, reference, strategy):
    async def scenario():
        service = await start(strategy)
        try:
            assert_close(await train(service, 0, STEPS), reference)
            workers = (await service.status())["workers"]
            assert [w["state"] for w in workers] == ["healthy", "healthy"] and all(w["node"] for w in workers)
        finally:
            await service.shutdown()

    asyncio.run(scenario())


def test_ray_fractional_gpus_share_one_device(local_ray, reference):
    """gpus_per_worker = 0.5: Ray places both workers on its one (logical) GPU; they train on CPU here."""

    async def scenario():
        service = await start("ddp", gpus_per_worker=0.5, device="cpu")
        try:
            assert_close(await train(service, 0, 3), reference[:3])
            status = await service.status()
            assert [w["gpus"] for w in status["workers"]] == [["0"], ["0"]] and status["devices"] == ["cpu", "cpu"]
        finally:
            await service.shutdown()

    asyncio.run(scenario())


def test_heterogeneous_services_share_one_cluster_and_the_impossible_is_one_line(local_ray, reference):
    """A training group (2 x 0.375 GPU) and a rollout group (1 x 0.25 GPU + a custom `inference` resource) at once,
    each its own placement group on the one logical GPU; a request the cluster can never hold fails at once."""
    from disttrain.errors import ConfigError

    async def scenario():
        training, rollout = await asyncio.gather(
            start("ddp", gpus_per_worker=0.375, cpus_per_worker=0.5, device="cpu"),
            TrainingService.options(nproc=1, launcher="ray", gpus_per_worker=0.25, cpus_per_worker=0.5,
                                    resources_per_worker={"inference": 1}, device="cpu").as_service(
                "gpt", model_args=job.MODEL, seed=job.SEED))
        try:
            assert_close(await train(training, 0, 3), reference[:3])
            out = await rollout.forward(next(job.batches(1)))
            assert out.shape[0] == job.GLOBAL_BATCH
            groups = [(await s.status())["workers"] for s in (training, rollout)]
            assert [[w["gpus"] for w in g] for g in groups] == [[["0"], ["0"]], [["0"]]]
            with pytest.raises(ConfigError, match=r"2 workers need GPU 2 and the cluster has GPU 1 in all"):
                await TrainingService.options(nproc=2, launcher="ray", gpus_per_worker=1.0).as_service("gpt")
            with pytest.raises(ConfigError, match=r"one worker needs CPU 3 and the cluster has CPU 2 on its largest"):
                await TrainingService.options(nproc=1, launcher="ray", cpus_per_worker=3.0).as_service("gpt")
        finally:
            await asyncio.gather(training.shutdown(), rollout.shutdown())

    asyncio.run(scenario())


def test_ray_actor_sigkill_restarts_from_the_checkpoint(local_ray, reference, tmp_path):
    async def scenario():
        service = await start("ddp", on_failure="restart", heartbeat_timeout_s=5.0,
                              checkpoint_dir=str(tmp_path / "ckpt"))
        try:
            losses = await train(service, 0, 4)
            await service.save()
            os.kill(service.group.workers[0].pid, signal.SIGKILL)
            with pytest.raises(WorkersRestarted) as info:
                await train(service, 4, 6)
            assert info.value.step == 4 and "worker 0" in str(info.value)
            losses += await train(service, 4, 8)
            assert_close(losses, reference[:8])
        finally:
            await service.shutdown()

    asyncio.run(scenario())



def test_ray_spread_places_workers_on_two_nodes(ray_env, reference):
    """A head and a second node (`ray start`, loopback, one CPU each): SPREAD puts one worker on each."""
    if ray.is_initialized():
        ray.shutdown()
    previous_mode = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "token"  # `ray start` leaves auth off unless told; the driver must agree
    port = free_port()
    common = ["--num-cpus=1", "--node-ip-address=127.0.0.1", "--disable-usage-stats"]
    head = [RAY, "start", "--head", f"--port={port}", "--include-dashboard=false", f"--temp-dir={ray_env}"]
    try:
        subprocess.run([*head, *common], check=True, capture_output=True, timeout=120)
        subprocess.run([RAY, "start", f"--address=127.0.0.1:{port}", *common], check=True, capture_output=True,
                       timeout=120)

        async def scenario():
            service = await start("ddp", ray_address=f"127.0.0.1:{port}", placement="SPREAD")
            try:
                assert_close(await train(service, 0, 5), reference[:5])
                nodes = [w["node"] for w in (await service.status())["workers"]]
                assert len(set(nodes)) == 2, f"both workers on one node: {nodes}"
            finally:
                await service.shutdown()

        asyncio.run(scenario())
    finally:
        ray.shutdown()
        subprocess.run([RAY, "stop", "--force"], capture_output=True, timeout=120)
        if previous_mode is None:
            del os.environ["RAY_AUTH_MODE"]
        else:
            os.environ["RAY_AUTH_MODE"] = previous_mode


def test_rl_example_learns_on_ray(ray_env):
    from test_service import run_rl_example

    if ray.is_initialized():
        ray.shutdown()
    run_rl_example("--launcher", "ray")
