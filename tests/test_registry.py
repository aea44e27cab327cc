"""A strategy registered from outside disttrain appears everywhere the registry is read, with no other file
changed: `config --list`, validation, `estimate-memory` and `verify` (whose workers import its module)."""

import json
import subprocess
import sys

from conftest import cli_env

DRIVER = """
import json, sys
import toy_strategy
from disttrain.parallel import register
for spec in toy_strategy.SPECS:
    register(spec)
from disttrain.cli import main
for argv in json.loads(sys.argv[1]):
    print("=== " + " ".join(argv), flush=True)
    print("exit", main(argv), flush=True)
"""


def _run(commands: list[list[str]], tmp_path) -> tuple[dict[str, tuple[str, int]], str]:
    proc = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(commands)], cwd=tmp_path, env=cli_env(tmp_path),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = {}
    for chunk in proc.stdout.split("=== ")[1:]:
        head, _, body = chunk.partition("\n")
        text, _, code = body.rpartition("exit ")
        out[head] = (text, int(code))
    return out, proc.stderr


def test_a_registered_strategy_shows_in_config_validation_estimate_memory_and_verify(tmp_path):
    small = ["--set", "model.n_layer=1", "--set", "model.d_model=32", "--set", "model.n_head=2",
             "--set", "model.seq_len=16", "--set", "data.global_batch_size=8", "--set", "data.micro_batch_size=2"]
    commands = [["config", "--list"],
                ["estimate-memory", "--world-size", "2", *small, "--set", "data.global_batch_size=4"],
                ["estimate-memory", "--world-size", "2", "--strategy", "toy_allreduce", "--set",
                 "parallel.cpu_offload=true", *small],
                ["verify", "--strategies", "toy_allreduce", "--nproc", "2", "--steps", "3", "--set",
                 "dist.threads_per_rank=1", "--set", "log.progress=false", "--set", "optim.grad_clip=0", *small]]
    results, stderr = _run(commands, tmp_path)
    listing, code = results["config --list"]
    assert code == 0 and "`toy_allreduce`: test only: gradients all-reduced by hand" in listing
    table, code = results[" ".join(commands[1])]
    assert code == 0 and any(line.startswith("toy_allreduce ") for line in table.splitlines())
    ddp_row = next(line for line in table.splitlines() if line.startswith("ddp "))
    toy_row = next(line for line in table.splitlines() if line.startswith("toy_allreduce "))
    # replicated like ddp, from its own spec's layout (one micro-batch per step: ddp's buckets are the gradients)
    assert toy_row.split()[1:] == ddp_row.split()[1:]
    _, code = results[" ".join(commands[2])]
    assert code == 2  # its spec does not read cpu_offload: validation refuses it
    assert "parallel.cpu_offload = true needs a strategy that uses it (zero2, fsdp, hsdp, deepspeed), not " \
           "'toy_allreduce'" in stderr
    report, code = results[" ".join(commands[3])]
    assert code == 0, report
    assert any(line.startswith("toy_allreduce") and line.rstrip().endswith("ok") for line in report.splitlines())
