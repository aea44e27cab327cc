"""Checkpoints wired into `disttrain train`: exact resume, elastic resume 2->1 and 1->2, refused changes,
and a rank killed (SIGKILL) in the middle of a save. Real processes, gloo, the real CLI."""

import json
import os
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import DISTTRAIN, cli_env, processes_mentioning, read_metrics, run_cli
from disttrain.cli import main

COMMON = ["--set", "model.n_layer=2", "--set", "model.d_model=64", "--set", "model.seq_len=32",
          "--set", "data.global_batch_size=16", "--set", "data.micro_batch_size=4", "--set", "train.steps=24",
          "--set", "train.eval_every=4", "--set", "train.eval_samples=32", "--set", "checkpoint.every=4",
          "--set", "log.progress=false", "--set", "train.log_every=1"]


def _train(tmp, name, nproc, *extra):
    result = run_cli(["train", "--nproc", str(nproc), "--set", f"run.out_dir={tmp}", "--set", f"run.name={name}",
                      *COMMON, *extra], tmp)
    assert result.returncode == 0, result.stderr
    return result


def _losses(run_dir):
    return [m["loss"] for m in read_metrics(run_dir)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Straight 0->24 runs and interrupted 0->12 (+ rerun to 24) runs, on 1 process and on 2 ranks."""
    tmp = tmp_path_factory.mktemp("resume")

    def straight_and_resumed(name, nproc):
        _train(tmp, f"{name}_straight", nproc)
        _train(tmp, f"{name}_resumed", nproc, "--set", "train.stop_at=12")
        shutil.copytree(tmp / f"{name}_resumed", tmp / f"{name}_at12")  # for the elastic resumes below
        result = _train(tmp, f"{name}_resumed", nproc)
        assert "resumed from checkpoint step 12" in result.stderr

    # the one-process runs go side by side with the 2-rank ones, in the core time those leave idle
    with ThreadPoolExecutor(1) as pool:
        single = pool.submit(straight_and_resumed, "single", 1)
        straight_and_resumed("ddp", 2)
        single.result()
    _train(tmp, "fsdp_at12", 2, "--set", "train.stop_at=12", "--set", "parallel.strategy=fsdp")
    _train(tmp, "zero1_at12", 2, "--set", "train.stop_at=12", "--set", "parallel.strategy=zero1")
    async_save = ["--set", "checkpoint.async_save=true"]
    _train(tmp, "ddp_async", 2, "--set", "train.stop_at=12", *async_save)
    assert "resumed from checkpoint step 12" in _train(tmp, "ddp_async", 2, *async_save).stderr
    fsdp_async = [*async_save, "--set", "parallel.strategy=fsdp"]
    _train(tmp, "fsdp_async", 2, "--set", "train.stop_at=12", *fsdp_async)
    assert "resumed from checkpoint step 12" in _train(tmp, "fsdp_async", 2, *fsdp_async).stderr
    return tmp


def test_async_sharded_checkpoints_resume_like_an_uninterrupted_run(runs):
    """fsdp with async saves: DCP writes each rank's shards in the background on a gloo group of its own."""
    manifest = json.loads((runs / "fsdp_async" / "checkpoints" / "step_24" / "manifest.json").read_text())
    assert manifest["layout"] == "dcp" and manifest["world_size"] == 2
    assert _losses(runs / "fsdp_async") == pytest.approx(_losses(runs / "ddp_straight"), abs=1e-5)


@pytest.mark.parametrize("name, resumed", [("single", "single_resumed"), ("ddp", "ddp_resumed"),
                                           ("ddp", "ddp_async")])
def test_resume_is_bitwise_identical_to_an_uninterrupted_run(runs, name, resumed):
    straight, resumed = read_metrics(runs / f"{name}_straight"), read_metrics(runs / resumed)
    assert [m["step"] for m in resumed] == list(range(1, 25))  # the interrupted run's lines are kept, once
    assert [m["loss"] for m in resumed] == [m["loss"] for m in straight]  # bitwise
    assert [m.get("eval_loss") for m in resumed] == [m.get("eval_loss") for m in straight]


def test_async_checkpoint_taken_while_the_next_step_ran_resumes_exactly(runs):
    """ddp_async's step_16 was copied in the background while step 17's forward and backward ran (the
    optimizer step waits for the copy): resuming from it repeats steps 17..20 bitwise."""
    name = "ddp_async_from16"
    shutil.copytree(runs / "ddp_async", runs / name)
    _train(runs, name, 2, "--resume", str(runs / name / "checkpoints" / "step_16"), "--set", "train.stop_at=20",
           "--set", "checkpoint.async_save=true")
    straight = read_metrics(runs / "ddp_straight")
    assert [m["loss"] for m in read_metrics(runs / name)][16:20] == [m["loss"] for m in straight][16:20]


@pytest.mark.parametrize("saved, nproc, reference", [("ddp_at12", 1, "ddp_straight"),
                                                     ("single_at12", 2, "single_straight")])
def test_resume_on_a_different_world_size_continues_the_same_stream(runs, saved, nproc, reference):
    name = f"{saved}_on{nproc}"
    shutil.copytree(runs / saved, runs / name)
    result = run_cli(["train", "--nproc", str(nproc), "--set", f"run.out_dir={runs}", "--set", f"run.name={name}",
                      *COMMON], runs)
    assert result.returncode == 0, result.stderr
    assert "resumed from checkpoint step 12" in result.stderr
    assert _losses(runs / name) == pytest.approx(_losses(runs / reference), abs=1e-5)


@pytest.mark.parametrize("saved, nproc, strategy", [("fsdp_at12", 1, "fsdp"), ("ddp_at12", 2, "fsdp"),
                                                    ("fsdp_at12", 1, "ddp"), ("zero1_at12", 1, "single"),
                                                    ("fsdp_at12", 2, "zero1")])
def test_resume_under_another_strategy_and_world_size(runs, saved, nproc, strategy):
    """Checkpoints hold the full, strategy-independent state: fsdp@2 -> fsdp@1, ddp@2 -> fsdp@2, fsdp@2 -> ddp@1,
    zero1@2 -> single, fsdp@2 -> zero1@2."""
    name = f"{saved}_to_{strategy}{nproc}"
    shutil.copytree(runs / saved, runs / name)
    result = _train(runs, name, nproc, "--set", f"parallel.strategy={strategy}")
    assert "resumed from checkpoint step 12" in result.stderr
    assert _losses(runs / name) == pytest.approx(_losses(runs / "single_straight"), abs=1e-5)


def test_changed_global_batch_is_refused_at_load_time(runs, monkeypatch, capsys):
    monkeypatch.chdir(runs)
    shutil.copytree(runs / "single_straight", runs / "changed")
    code = main(["train", "--set", f"run.out_dir={runs}", "--set", "run.name=changed", *COMMON,
                 "--set", "data.global_batch_size=32", "--set", "model.d_model=32"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 2  # the "training ..." banner, then the error line
    assert "data.global_batch_size was 16, now 32" in err[-1] and "model.d_model was 64, now 32" in err[-1]


def _rank_pid(run_dir: str, rank: int) -> int:
    """The worker process of `rank` in the job of `run_dir`, from its status file (monitor.py)."""
    path = Path(run_dir) / "status" / f"rank{rank}.json"
    deadline = time.monotonic() + 30
    while True:
        try:
            return json.loads(path.read_text())["pid"]
        except (OSError, ValueError, KeyError):
            assert time.monotonic() < deadline, f"no status file of rank {rank} in {run_dir}"
            time.sleep(0.05)


def test_sigkill_during_a_save_resumes_from_the_previous_checkpoint(tmp_path):
    args = ["--set", "model.name=tiny_models:bigram_with_ballast", "--set", "optim.lr=0.05", "--set",
            "train.steps=20", "--set", "checkpoint.every=5", "--set", "train.eval_every=0", "--set",
            "log.progress=false", "--set", "data.global_batch_size=8", "--set", "data.micro_batch_size=4"]
    _train_kill = ["train", "--nproc", "2", "--set", f"run.out_dir={tmp_path}", "--set", "run.name=killed", *args]
    straight = run_cli(["train", "--nproc", "2", "--set", f"run.out_dir={tmp_path}", "--set", "run.name=straight",
                        *args], tmp_path)
    assert straight.returncode == 0, straight.stderr

    marker = str(tmp_path / "killed")
    proc = subprocess.Popen(DISTTRAIN + _train_kill, cwd=tmp_path, env=cli_env(tmp_path),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    target = tmp_path / "killed" / "checkpoints" / "step_10"
    deadline = time.monotonic() + 120
    try:
        while not (target.is_dir() and any(target.iterdir())):  # the save of step 10 has begun
            assert proc.poll() is None and time.monotonic() < deadline, "never reached the second save"
            time.sleep(0.001)
        os.kill(_rank_pid(marker, 0), signal.SIGKILL)
        assert proc.wait(timeout=60) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not (target / "COMMITTED").exists(), "the save finished before the kill; make the ballast bigger"
    assert json.loads((tmp_path / "killed" / "checkpoints" / "step_5" / "manifest.json").read_text())["step"] == 5

    resumed = run_cli(_train_kill, tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from checkpoint step 5" in resumed.stderr
    assert _losses(tmp_path / "killed")[-1] == _losses(tmp_path / "straight")[-1]
    assert processes_mentioning(marker) == []


def test_ckpt_list_and_export_for_inference(runs, capsys):
    import torch
    from safetensors.torch import load_file

    from disttrain.config import load_config
    from disttrain.models import build_model

    assert main(["ckpt", "list", str(runs / "ddp_straight")]) == 0
    out = capsys.readouterr().out
    assert "24  committed" in out and "(latest)" in out and "16  committed" in out and "step" in out
    assert " 4  committed" not in out  # keep_last = 3: steps 16, 20, 24 (and the best eval's)
    weights = runs / "export" / "model.safetensors"
    assert main(["ckpt", "export", str(runs / "ddp_straight" / "checkpoints" / "step_24"), str(weights)]) == 0
    model = build_model(load_config(runs / "ddp_straight" / "config.toml").model)
    model.load_state_dict(load_file(weights))  # strict: every name present, tied weights included
    state = main(["ckpt", "verify", str(runs / "ddp_straight" / "checkpoints" / "step_24")])
    assert state == 0 and isinstance(model.tok_emb.weight, torch.Tensor)
