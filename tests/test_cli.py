"""The command line, end to end: the default job, user errors, signals, env."""

import signal
import subprocess
import sys
import time

import pytest

from conftest import DISTTRAIN, cli_env, processes_mentioning, read_metrics, run_cli
from disttrain.cli import main


def test_train_with_no_arguments_trains_the_default_job(tmp_path):
    result = run_cli(["train"], tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr
    metrics = read_metrics(tmp_path / "runs" / "default")
    losses = [m["loss"] for m in metrics]
    assert len(losses) == 100
    assert sum(losses[-10:]) / 10 < losses[0] - 2.5  # from ~5.5 (uniform over bytes) to well below 3
    assert metrics[-1]["eval_loss"] < 3.0
    assert "100/100" in result.stderr  # the progress line
    assert (tmp_path / "runs" / "default" / "config.toml").is_file()


BAD = [
    (["--set", "data.global_batch_size=30", "--nproc", "2"], "data.global_batch_size = 30 is not divisible"),
    (["--set", "parallel.strategy=fsdpp"], "parallel.strategy = 'fsdpp' is not known"),
    (["--set", "optim.lrr=1e-3"], "did you mean 'lr'"),
    (["--set", "train.steps=0"], "train.steps = 0"),
    (["--set", "data.source=missing.txt"], "file not found"),
    (["--set", "dist.device=cuda"], "no CUDA GPU is visible"),
    (["--set", "model.name=no_such_module:build"], "cannot import 'no_such_module'"),
    (["missing.toml"], "config file 'missing.toml' does not exist"),
    (["--set", "optim.lr"], "expected section.key=value"),
]


@pytest.mark.parametrize("args, message", BAD)
def test_bad_config_is_one_line_and_exit_2(args, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("disttrain: error: ") and message in err[0]
    assert not (tmp_path / "runs").exists()  # rejected before anything was written or started


def test_bad_config_in_a_real_process_has_no_traceback_and_leaves_nothing(tmp_path):
    marker = f"marker-{tmp_path.name}"
    result = run_cli(["train", "--nproc", "2", "--set", "data.global_batch_size=7", "--set",
                      f"run.name={marker}"], tmp_path)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert "data.global_batch_size = 7" in result.stderr
    assert processes_mentioning(marker) == []


@pytest.mark.parametrize("nproc, sig, code", [(2, signal.SIGTERM, 143), (1, signal.SIGINT, 130)])
def test_signal_stops_every_rank_without_orphans(nproc, sig, code, tmp_path):
    marker = str(tmp_path / "runs")
    proc = subprocess.Popen(DISTTRAIN + ["train", "--nproc", str(nproc), "--set", "train.steps=100000",
                                         "--set", f"run.out_dir={marker}", "--set", "log.progress=false"],
                            cwd=tmp_path, env=cli_env(tmp_path), stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        metrics = tmp_path / "runs" / "default" / "metrics.jsonl"
        deadline = time.monotonic() + 60
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, "training never started"
            time.sleep(0.2)
        assert len(processes_mentioning(marker)) == nproc + (nproc > 1)  # launcher (+ ranks)
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == code
        assert "stopped by" in proc.stderr.read()
        deadline = time.monotonic() + 10
        while processes_mentioning(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert processes_mentioning(marker) == []
    finally:
        if proc.poll() is None:
            import os

            os.killpg(proc.pid, signal.SIGKILL)


def test_env_reports_versions_and_launcher(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    for key in ("torch:", "distributed backends:", "gloo", "detected launcher:", "none (single process)"):
        assert key in out


def test_config_list_documents_every_setting(capsys):
    assert main(["config", "--list"]) == 0
    out = capsys.readouterr().out
    assert "optim.lr (float, default 0.002)" in out and "dist.timeout_s" in out


def test_launch_refuses_a_missing_script(capsys):
    assert main(["launch", "--nproc", "2", "nope.py"]) == 2
    assert "script 'nope.py' not found" in capsys.readouterr().err


def test_module_entry_point_runs(tmp_path):
    result = subprocess.run([sys.executable, "-m", "disttrain", "config", "--set", "optim.lr=0.5"],
                            capture_output=True, text=True, timeout=60, env=cli_env(tmp_path))
    assert result.returncode == 0 and "lr = 0.5" in result.stdout


def test_user_model_factory_trains_from_the_cli(tmp_path, monkeypatch, capsys):
    from conftest import SCRIPTS

    monkeypatch.syspath_prepend(str(SCRIPTS))
    monkeypatch.chdir(tmp_path)
    args = ["train", "--set", "model.name=tiny_models:bigram", "--set", "train.steps=30", "--set", "optim.lr=0.1",
            "--set", "log.progress=false", "--set", "train.eval_every=0", "--set", "dist.threads_per_rank=1"]
    assert main(args) == 0
    losses = [m["loss"] for m in read_metrics(tmp_path / "runs" / "default")]
    assert len(losses) == 30 and losses[-1] < losses[0] - 1.0
    assert main([*args[:2], "model.name=tiny_models:not_a_module"]) == 2
    assert "returned str, not a torch.nn.Module" in capsys.readouterr().err
