"""Experiment trackers: Weights & Biases (offline files) and MLflow (a local file store) get every logged scalar of a
run, and a tracker that is not installed is one line before anything starts."""

import json
import sys

import pytest

from conftest import read_metrics, run_cli
from disttrain.config import ConfigError, load_config, validate

TINY = ["--set", "model.n_layer=1", "--set", "model.d_model=32", "--set", "model.n_head=2", "--set",
        "model.seq_len=16", "--set", "data.global_batch_size=8", "--set", "train.steps=4", "--set",
        "train.eval_every=2", "--set", "log.progress=false"]


def test_wandb_offline_and_mlflow_files_get_the_runs_scalars(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # (the default store: files in the run folder)
    result = run_cli(["train", "--set", f"run.out_dir={tmp_path}", "--set", "run.name=tracked", *TINY,
                      "--set", "log.wandb=true", "--set", "log.mlflow=true"], tmp_path, timeout=180,
                     env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "tracked"
    lines = read_metrics(run_dir)
    losses = [m["loss"] for m in lines]
    client = mlflow.MlflowClient((run_dir / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("disttrain").experiment_id])
    history = sorted(client.get_metric_history(run.info.run_id, "loss"), key=lambda m: m.step)
    assert [m.step for m in history] == [m["step"] for m in lines] == [2, 4]  # the evaluations' lines (log_every 10)
    assert [m.value for m in history] == pytest.approx(losses)
    assert run.data.params["optim.lr"] == str(load_config(None).optim.lr) and run.info.run_name == "tracked"
    eval_steps = [m.step for m in client.get_metric_history(run.info.run_id, "eval_loss")]
    assert eval_steps == [m["step"] for m in lines if "eval_loss" in m]
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    (record,) = offline.glob("run-*.wandb")  # what `wandb sync` uploads: protobuf records with JSON values
    data = record.read_bytes()
    assert all(json.dumps(loss).encode() in data for loss in losses) and b"eval_loss" in data


@pytest.mark.parametrize("tracker", ["wandb", "mlflow"])
def test_a_tracker_that_is_not_installed_is_one_line(monkeypatch, tracker):
    monkeypatch.setitem(sys.modules, tracker, None)  # as if it were not installed
    with pytest.raises(ConfigError, match=rf"log.{tracker} = true but the {tracker} package is not installed; "
                                          rf"pip install 'disttrain\[{tracker}\]'"):
        validate(load_config(None, [f"log.{tracker}=true"]))
