"""The forked worker tier (service/fork.py) and the TrainingService given live objects: workers inherit the
driver's model, optimizer and loss function (no serialisation) and train like the import-path form; forking is
refused in one line where it is unsafe. The forking drivers are processes of their own (tests/scripts/fork_job.py):
a pytest process has usually started torch's CPU thread pool, which rightly refuses forking."""

import asyncio
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from conftest import SCRIPTS, cli_env
from disttrain.errors import ConfigError
from disttrain.service import ForkUnsafe, TrainingService, Worker

sys.path.insert(0, str(SCRIPTS))
import service_job as job  # noqa: E402

STEPS = 10


def fork_job(tmp_path: Path, *args: str) -> dict:
    result = subprocess.run([sys.executable, str(SCRIPTS / "fork_job.py"), *args], cwd=tmp_path,
                            env=cli_env(tmp_path), capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_forked_workers_inherit_objects_and_talk_in_frames(tmp_path):
    out = fork_job(tmp_path, "workers")
    assert out["messages"] == [{"rank": 0, "world": 2, "echo": 7}, {"rank": 1, "world": 2, "echo": 7}]
    assert out["y"] == [(torch.arange(6.0) + 2).tolist()] * 2  # 2 x the ones sent + the inherited tensor
    assert out["codes"] == [0, 0] and out["failing"] == [True, 1]


def test_live_model_optimizer_and_loss_match_the_import_path_reference(tmp_path):
    torch.set_num_threads(1)
    reference = job.reference(STEPS)
    out = fork_job(tmp_path, "live", str(STEPS))
    assert max(abs(a - b) for a, b in zip(out["losses"], reference, strict=True)) < 1e-5, (out["losses"], reference)
    assert all(not Path(f"/proc/{pid}").exists() for pid in out["pids"])  # forked, then reaped
    assert out["families"] == ["AF_UNIX", "AF_UNIX"]  # each talks to the driver over its socketpair, not TCP


def test_a_driver_whose_thread_pool_started_is_refused_in_one_line(tmp_path):
    refused = fork_job(tmp_path, "native")["refused"]
    assert refused and "native thread(s)" in refused and "torch.set_num_threads(1)" in refused, refused


def test_python_threads_ray_and_the_thread_hosted_callers_are_refused_in_one_line():
    release = threading.Event()
    other = threading.Thread(target=release.wait, name="busy")
    other.start()
    try:
        # (other tests may leave idle threads behind, e.g. trio's thread cache: the count varies)
        with pytest.raises(ForkUnsafe, match=r"\d+ other Python thread.*busy.*pass import paths instead"):
            Worker(lambda conn: 0)
    finally:
        release.set()
        other.join()
    linear = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="'ray' launcher cannot do; pass import paths"):
        asyncio.run(TrainingService.options(nproc=2, launcher="ray").as_service(model=linear))
    with pytest.raises(ForkUnsafe, match="as_blocking_service: objects .model. reach workers by forking"):
        TrainingService.options(nproc=2).as_blocking_service(model=linear)
    with pytest.raises(ConfigError, match="give either model= .* or model_fn="):
        asyncio.run(TrainingService.options(nproc=2).as_service("gpt", model=linear))
    assert not [t for t in threading.enumerate() if t.name == "disttrain-service"]  # no service loop started
