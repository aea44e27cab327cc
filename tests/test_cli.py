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
    assert [m["step"] for m in metrics] == list(range(10, 101, 10))  # a line every train.log_every = 10 steps
    losses = [m["loss"] for m in metrics]
    assert losses[-1] < min(losses[0] - 1.5, 3.0)  # well below step 10's loss (from ~5.5, uniform over bytes), and 3
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
    (["--set", "model.freeze=blocks.0.*,tok_embb.*", "--nproc", "2"], "'tok_embb.*' matches no parameter"),
    (["--set", "model.freeze=*"], "freezes every parameter of the model"),
]


@pytest.mark.parametrize("args, message", BAD)
def test_bad_config_is_one_line_and_exit_2(args, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("disttrain: error: ") and message in err[0]
    assert not (tmp_path / "runs").exists()  # rejected before anything was written or started


@pytest.mark.parametrize("args, message", [
    (["config", "binary.toml"], "config file 'binary.toml': cannot read it (not UTF-8 text)"),
    (["estimate-memory", "--world-size", "2", "--budget-gib", "0"], "--budget-gib 0: give a device's memory"),
    (["estimate-memory", "--world-size", "2", "--budget-gib", "nan"], "--budget-gib nan: give a device's memory"),
    (["deepspeed-config", "--set", "model.n_head=0", "-o", "ds.json"], "model.n_head = 0: must be > 0"),
    (["deepspeed-config", "-o", "a_folder"], "-o a_folder is a folder"),
    (["deepspeed-config", "--set", "parallel.strategy=deepspeed", "--set", "parallel.deepspeed_config=zero5.json",
      "-o", "ds.json"], "'zero_optimization' = 5 is not a JSON object"),
    (["verify", "--tolerance", "-1"], "verify --tolerance -1: give a finite difference >= 0"),
    (["verify", "--strategies", ","], "verify --strategies ',' names none"),
])
def test_other_commands_refuse_bad_input_in_one_line(args, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "binary.toml").write_bytes(b"\xff\xfe[run]\n")
    (tmp_path / "a_folder").mkdir()
    (tmp_path / "zero5.json").write_text('{"zero_optimization": 5}')
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("disttrain: error: ") and message in err and "\n" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_folder", "binary.toml", "zero5.json"]  # nothing new


def test_a_run_folder_that_cannot_be_made_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_file").write_text("")
    assert main(["train", "--set", "run.out_dir=a_file", "--set", "train.steps=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("disttrain: error: run.out_dir / run.name 'a_file/default': cannot create the folder"), err
    assert "\n" not in err


@pytest.mark.parametrize("args, message", [
    (["train", "--bogus"], "unrecognized arguments: --bogus; see `disttrain --help`"),
    (["bench", "nope"], "argument name: invalid choice: 'nope'"),
    (["bench", "comm", "--factor", "3"], "argument --factor: invalid choice: 3 (choose from 2, 4); see `disttrain "
     "bench comm --help`"),
    (["bench", "scaling", "--steps", "two"], "argument --steps: invalid int value: 'two'"),
])
def test_a_bad_command_line_is_one_line_and_exit_2(args, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stopped:  # argparse's own errors, before anything runs
        main(args)
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("disttrain: error: ") and message in err[0], err
    assert list(tmp_path.iterdir()) == []


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
        deadline = time.monotonic() + 120  # (a loaded machine starts slowly)
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


@pytest.mark.parametrize("args, says", [
    (["-m", "nosuchpkg.train"], "-m nosuchpkg.train: no such module"),
    (["-m", ".relative"], "-m .relative: no such module"),
    (["--master-port", "70000", "job.py"], "--master-port 70000: give a port from 1 to 65535"),
    (["--master-port", "0", "job.py"], "--master-port 0: give a port from 1 to 65535"),
    (["--rdzv-endpoint", "host:99999", "--run-dir", "runs/x", "job.py"], "--rdzv-endpoint host:99999"),
    (["--rdzv-endpoint", "host:abc", "job.py"], "--rdzv-endpoint host:abc: expected HOST:PORT"),
    (["--run-dir", "a_file/run", "job.py"], "--run-dir 'a_file/run': cannot create the folder"),
])
def test_launch_refuses_bad_flags_in_one_line(tmp_path, monkeypatch, capsys, args, says):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.py").write_text("print('ran')\n")
    (tmp_path / "a_file").write_text("")
    assert main(["launch", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("disttrain: error: " + says) and "\n" not in err, err
    assert not (tmp_path / "runs").exists()  # refused before its run folder was made


def test_module_entry_point_runs(tmp_path):
    result = subprocess.run([sys.executable, "-m", "disttrain", "config", "--set", "optim.lr=0.5"],
                            capture_output=True, text=True, timeout=60, env=cli_env(tmp_path))
    assert result.returncode == 0 and "lr = 0.5" in result.stdout


def test_user_model_factory_trains_from_the_cli(tmp_path, monkeypatch, capsys):
    from conftest import SCRIPTS

    monkeypatch.syspath_prepend(str(SCRIPTS))
    monkeypatch.chdir(tmp_path)
    args = ["train", "--set", "model.name=tiny_models:bigram", "--set", "train.steps=30", "--set", "optim.lr=0.1",
            "--set", "log.progress=false", "--set", "train.eval_every=0", "--set", "dist.threads_per_rank=1",
            "--set", "train.log_every=1"]
    assert main(args) == 0
    losses = [m["loss"] for m in read_metrics(tmp_path / "runs" / "default")]
    assert len(losses) == 30 and losses[-1] < losses[0] - 1.0
    assert main([*args[:2], "model.name=tiny_models:not_a_module"]) == 2
    assert "returned str, not a torch.nn.Module" in capsys.readouterr().err


@pytest.mark.parametrize("nproc", ["0", "-1"])
def test_nproc_below_one_is_one_line_exit_2(tmp_path, nproc):
    result = run_cli(["train", "--nproc", nproc], tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == f"disttrain: error: dist.nproc = {nproc}: must be >= 1; use --nproc 1 or more"
    assert not (tmp_path / "runs").exists()


def test_config_command_validates(tmp_path):
    (tmp_path / "my.toml").write_text('[parallel]\nstrategy = "fsdp2"\n')
    result = run_cli(["config", "my.toml"], tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip() == "disttrain: error: parallel.strategy = 'fsdp2' is not known; did you mean 'fsdp'?"
    ok = run_cli(["config", "--set", "parallel.precision=bf16"], tmp_path)
    assert ok.returncode == 0 and 'precision = "bf16-mixed"' in ok.stdout


def test_exit_codes_come_from_one_function():
    """Both entry points (cli.main, run.main) print what errors.exit_code_and_message says."""
    import torch

    from disttrain.checkpoint import (
        CheckpointError,
        CheckpointManager,  # noqa: F401 - the public home of CheckpointError
    )
    from disttrain.config import ConfigError
    from disttrain.errors import exit_code_and_message
    from disttrain.signals import Preempted

    assert exit_code_and_message(ConfigError("x = 1; fix")) == (2, "disttrain: error: x = 1; fix")
    assert exit_code_and_message(CheckpointError("bad")) == (1, "disttrain: error: bad")
    assert exit_code_and_message(Preempted(3, signal.SIGINT)) == (130, "disttrain: stopped by SIGINT after step 3")
    for oom in (torch.OutOfMemoryError("CUDA out of memory. Tried 2 GiB\nmore"), MemoryError()):
        code, line = exit_code_and_message(oom)
        assert code == 1 and line.startswith("disttrain: error: out of memory (") and "estimate-memory" in line
        assert "\n" not in line
    assert exit_code_and_message(RuntimeError("a bug")) is None  # a bug keeps its traceback
    assert exit_code_and_message(KeyError("k")) is None
