"""scripts/: the launch scripts with named arguments, run as a user runs them (two local processes through each
single-node script, two nodes on loopback through the multi-node one), and their usage text on bad arguments."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cli_env, free_port

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
TINY = """run:\n  out_dir: {out}\nmodel:\n  n_layer: 1\n  d_model: 32\n  n_head: 2\n  seq_len: 16\ndata:
  global_batch_size: 8\n  micro_batch_size: 4\ntrain:\n  steps: 4\n  eval_every: 0\n  log_every: 1
log:\n  progress: false\n"""


def _env(tmp_path):
    bin_dir = str(Path(sys.executable).parent)
    return {**cli_env(tmp_path), "PYTHON": sys.executable, "PATH": bin_dir + os.pathsep + os.environ["PATH"]}



def _run(script, tmp_path, *args, name):
    return subprocess.Popen([str(SCRIPTS / script), *args, "--config", str(tmp_path / "tiny.yaml"), "--",
                             "--set", f"run.name={name}"], cwd=tmp_path, env=_env(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_each_script_trains_two_processes_with_the_same_losses(tmp_path):
    (tmp_path / "tiny.yaml").write_text(TINY.format(out=tmp_path))
    single = [_run("train_dist_torchrun.sh", tmp_path, "--num_gpus", "2", "--master_port", str(free_port()),
                   name="torchrun"),
              _run("train_dist_launch.sh", tmp_path, "--num_gpus", "2", "--master_port", str(free_port()),
                   name="launch")]
    port = str(free_port())  # two nodes of one process each, on loopback; node 1 starts first
    nodes = [_run("train_multinode.sh", tmp_path, "--num_nodes", "2", "--node_rank", str(rank), "--master_port",
                  port, "--num_gpus", "1", name="multinode") for rank in (1, 0)]
    for proc in single + nodes:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-3000:]
    losses = {name: _losses(tmp_path / name) for name in ("torchrun", "launch", "multinode")}
    assert len(losses["torchrun"]) == 4
    assert losses["launch"] == pytest.approx(losses["torchrun"], abs=1e-6)
    assert losses["multinode"] == pytest.approx(losses["torchrun"], abs=1e-6)


@pytest.mark.parametrize("args, says", [(["--num_gpus", "two"], "--num_gpus 'two' is not a number >= 1"),
                                        (["--num_gpus"], "--num_gpus needs a value"),
                                        (["--gpus", "2"], "unknown argument '--gpus'"),
                                        (["--num_nodes", "2", "--node_rank", "2"], "--node_rank '2' must be 0 .. 1"),
                                        (["--config", "missing.yaml"], "--config 'missing.yaml' does not exist")])
def test_a_bad_argument_prints_the_usage_and_exits_2(tmp_path, args, says):
    for script in ("train_dist_torchrun.sh", "train_dist_launch.sh", "train_multinode.sh"):
        result = subprocess.run([str(SCRIPTS / script), *args], cwd=tmp_path, env=_env(tmp_path),
                                capture_output=True, text=True, timeout=30)
        assert result.returncode == 2 and says in result.stderr and "usage:" in result.stderr, result.stderr
