"""What a new user meets first: config files in TOML, YAML and JSON, the dist section from the environment, the
launch spellings torchrun users type, `train --dry-run`, `--version`, and a rendezvous that cannot complete."""

import json
import os
import signal
import subprocess
import time

import pytest

from conftest import DISTTRAIN, cli_env, free_port, run_cli
from disttrain.cli import main
from disttrain.config import ConfigError, DistConfig, from_env, load_config, to_env

SETTINGS = {"model": {"n_layer": 2, "d_model": 64}, "optim": {"lr": 0.002}, "dist": {"nproc": 2, "backend": "gloo"},
            "parallel": {"strategy": "fsdp"}}
TOML = """[model]\nn_layer = 2\nd_model = 64\n[optim]\nlr = 0.002\n[dist]\nnproc = 2\nbackend = "gloo"\n
[parallel]\nstrategy = "fsdp"\n"""
YAML = """model:\n  n_layer: 2\n  d_model: 64\noptim:\n  lr: 0.002\ndist:\n  nproc: 2\n  backend: gloo\n
parallel:\n  strategy: fsdp\n"""


def test_toml_yaml_and_json_files_give_the_same_config(tmp_path):
    (tmp_path / "c.toml").write_text(TOML)
    (tmp_path / "c.yaml").write_text(YAML)
    (tmp_path / "c.json").write_text(json.dumps(SETTINGS))
    configs = [load_config(tmp_path / name, environ={}) for name in ("c.toml", "c.yaml", "c.json")]
    assert configs[0].to_dict() == configs[1].to_dict() == configs[2].to_dict()
    assert configs[0].model.d_model == 64 and configs[0].dist.nproc == 2 and configs[0] != load_config(None)
    # the same one-line errors as TOML: an unknown key, a syntax error with its place, a top level that is a list
    (tmp_path / "typo.yaml").write_text("optim:\n  lrr: 0.1\n")
    with pytest.raises(ConfigError, match="unknown setting 'optim.lrr': did you mean 'lr'"):
        load_config(tmp_path / "typo.yaml", environ={})
    (tmp_path / "broken.yaml").write_text("model:\n  n_layer: 2\n d_model: [64\n")
    with pytest.raises(ConfigError, match=r"broken.yaml' is not valid YAML \(line \d+, column \d+: .*fix the syntax"):
        load_config(tmp_path / "broken.yaml", environ={})
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="top level of the JSON must be a mapping of sections"):
        load_config(tmp_path / "list.json", environ={})


def test_the_dist_section_goes_to_and_from_the_environment_with_set_over_env_over_file(tmp_path):
    dist = DistConfig(nproc=3, backend="gloo", timeout_s=12.5, ray_address="127.0.0.1:6379")
    env = to_env(dist)
    assert env["DISTTRAIN_DIST_NPROC"] == "3" and env["DISTTRAIN_DIST_BACKEND"] == "gloo"
    assert from_env(env) == dist
    (tmp_path / "c.yaml").write_text(YAML)  # the file says nproc 2
    assert load_config(tmp_path / "c.yaml", environ={}).dist.nproc == 2
    assert load_config(tmp_path / "c.yaml", environ={"DISTTRAIN_DIST_NPROC": "4"}).dist.nproc == 4  # env > file
    assert load_config(tmp_path / "c.yaml", ["dist.nproc=1"], environ={"DISTTRAIN_DIST_NPROC": "4"}).dist.nproc == 1
    with pytest.raises(ConfigError, match="DISTTRAIN_DIST_NPROCS: no setting dist.nprocs; did you mean 'nproc'"):
        from_env({"DISTTRAIN_DIST_NPROCS": "2"})
    with pytest.raises(ConfigError, match="DISTTRAIN_DIST_NPROC='two': .*fix or unset it"):
        from_env({"DISTTRAIN_DIST_NPROC": "two"})
    # through the CLI: one line, exit 2
    result = run_cli(["train", "--dry-run"], tmp_path, env={"DISTTRAIN_DIST_TIMEOUT": "5"})
    assert result.returncode == 2 and "DISTTRAIN_DIST_TIMEOUT" in result.stderr and "timeout_s" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def dry_run(capsys, *args: str) -> str:
    assert main(["train", "--dry-run", *args]) == 0
    return capsys.readouterr().out


def test_dry_run_and_the_spellings_torchrun_users_type(tmp_path, capsys):
    out_dir = ["--set", f"run.out_dir={tmp_path}"]
    for spelling in ("--nproc", "--nproc-per-node", "--nproc_per_node"):
        out = dry_run(capsys, spelling, "2", "--set", "parallel.strategy=fsdp", *out_dir)
        assert "world:      2 rank(s) = 1 node(s) x 2 process(es)" in out and "layout:     dp_shard2" in out
    assert "batch:      32 sequences per step = 2 data shard(s) x 16 = 2 micro-batch(es) of 8" in out
    assert "memory:     per rank:" in out and "total" in out and "--nproc-per-node 2" in out
    from disttrain.config import load_config
    from disttrain.models.gpt import GPT

    named = dict(GPT(load_config(None, []).model).named_parameters())
    share = sum(p.numel() for n, p in named.items() if n.startswith(("tok_emb.", "blocks.0."))) / \
        sum(p.numel() for p in named.values())
    out = dry_run(capsys, "--set", "model.freeze=tok_emb.*,blocks.0.*", *out_dir)  # what model.freeze keeps back
    assert f"model:      gpt ({share:.0%} of its parameters frozen by model.freeze)" in out
    assert f"x {os.cpu_count()} process(es)" in dry_run(capsys, "--nproc", "cpu", *out_dir)
    assert "x 1 process(es)" in dry_run(capsys, "--nproc", "auto", *out_dir)  # no GPU here: 1
    out = dry_run(capsys, "--nproc", "2", "--nnodes", "2", "--master_addr", "10.0.0.1", "--master-port", "1234",
                  "--rdzv-id", "job7", "--node_rank", "1", *out_dir)
    assert "--rdzv-endpoint 10.0.0.1:1234 --rdzv-id job7" in out and "world:      4 rank(s) = 2 node(s)" in out
    assert "join_timeout=" in out
    assert not any(tmp_path.iterdir())  # nothing written
    with pytest.raises(SystemExit) as version:
        main(["--version"])
    assert version.value.code == 0 and capsys.readouterr().out.startswith("disttrain 0.")
    assert main(["train", "--dry-run", "--nproc", "gpu"]) == 2
    assert "no CUDA GPU is visible" in capsys.readouterr().err


def test_launch_runs_a_module_with_the_multi_node_flags(tmp_path):
    result = run_cli(["launch", "--nproc-per-node", "2", "--rdzv-id", "hello", "--run-dir", str(tmp_path / "run"),
                      "-m", "hello_ranks"], tmp_path)
    assert result.returncode == 0, result.stderr
    logs = "".join(p.read_text() for p in (tmp_path / "run").rglob("stdout.log"))
    assert "hello from rank 0 of 2" in logs and "hello from rank 1 of 2" in logs
    assert "--rdzv-id hello" in result.stderr
    forked = run_cli(["launch", "--fork", "--nproc", "2", "--run-dir", str(tmp_path / "forked"), "-m", "hello_ranks"],
                     tmp_path)  # the module run by runpy in ranks forked from the preloaded server
    assert forked.returncode == 0, forked.stderr
    logs = "".join(p.read_text() for p in (tmp_path / "forked").rglob("stdout.log"))
    assert "hello from rank 0 of 2" in logs and "hello from rank 1 of 2" in logs
    missing = run_cli(["launch", "-m", "no_such_module_here"], tmp_path)
    assert missing.returncode == 2 and "-m no_such_module_here: no such module" in missing.stderr



@pytest.mark.parametrize("node_rank, says", [(1, "could not be reached within 3 s"),
                                             (0, "did not complete within 3 s")])
def test_a_rendezvous_that_cannot_complete_is_named_within_the_startup_timeout(tmp_path, node_rank, says):
    """Node 1 pointed at an endpoint nobody listens on; node 0 waiting for a node that never comes."""
    endpoint = f"127.0.0.1:{free_port()}"
    start = time.monotonic()
    result = run_cli(["train", "--nproc", "1", "--nnodes", "2", "--node-rank", str(node_rank), "--rdzv-endpoint",
                      endpoint, "--set", "dist.startup_timeout_s=3", "--set", f"run.out_dir={tmp_path}",
                      "--set", "log.progress=false"], tmp_path, timeout=60)
    assert time.monotonic() - start < 20
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2 and endpoint in last and says in last and "Traceback" not in result.stderr, \
        result.stderr[-2000:]
    assert "node 0 started" in last and "GLOO_SOCKET_IFNAME" in last and f"this is node {node_rank}" in last


def _nodes(tmp_path, ranks: list[int], timeout_s: int) -> list[tuple[int, str]]:
    """One `disttrain train` node (1 process) per entry of `ranks` on a loopback rendezvous: (exit code, stderr)."""
    endpoint = f"127.0.0.1:{free_port()}"
    args = ["train", "--nproc", "1", "--nnodes", str(len(ranks)), "--rdzv-endpoint", endpoint, "--set",
            f"dist.startup_timeout_s={timeout_s}", "--set", f"run.out_dir={tmp_path}", "--set", "log.progress=false",
            "--set", "train.steps=2", "--set", "data.global_batch_size=48"]
    nodes = [subprocess.Popen(DISTTRAIN + args + ["--node-rank", str(rank)], cwd=tmp_path, env=cli_env(tmp_path),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
             for rank in ranks]
    try:
        return [(node.wait(timeout=90), node.stderr.read().replace(endpoint, "ENDPOINT")) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)


def test_two_nodes_given_the_same_node_rank_are_named_before_training(tmp_path):
    """Nodes 0, 1, 1: c10d numbers the nodes by arrival, so the rendezvous completes; the workers then compare
    the ranks the nodes were given, and every node ends with exit 2 naming the duplicate and the missing rank."""
    for code, stderr in _nodes(tmp_path, [0, 1, 1], 60):
        assert code == 2 and "Traceback" not in stderr, stderr[-2000:]
        assert ("--node-rank 1 was given to 2 nodes" in stderr and "rendezvous at ENDPOINT" in stderr
                and "node ranks seen 0, 1, 1, missing 2" in stderr), stderr[-2000:]
    assert not (tmp_path / "default" / "metrics.jsonl").exists()


def test_two_nodes_given_node_rank_0_are_named_by_the_one_that_cannot_host(tmp_path):
    """Node 0 hosts the rendezvous store (`is_host`), so a second node 0 cannot open its port: named at once; the
    first waits for the node that never comes until `dist.startup_timeout_s`."""
    results = _nodes(tmp_path, [0, 0], 4)
    assert [code for code, _ in results] == [2, 2], results
    lines = [stderr.strip().splitlines()[-1] for _, stderr in results]
    assert sum("node 0 could not host the rendezvous at ENDPOINT: its port is taken" in line for line in lines) == 1
    assert sum("did not complete within 4 s" in line for line in lines) == 1, lines


def test_a_node_rank_outside_the_nodes_is_refused_in_one_line(tmp_path):
    result = run_cli(["train", "--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "127.0.0.1:1"], tmp_path)
    assert result.returncode == 2 and result.stderr.strip() == (
        "disttrain: error: --node-rank 2: must be from 0 to 1 with --nnodes 2; give each node its own rank")


def test_shell_completion_completes_commands_flags_and_choices(tmp_path):
    import subprocess

    from conftest import DISTTRAIN

    probe = """source <({disttrain} completion bash)
complete_words() {{ COMP_WORDS=("$@"); COMP_CWORD=$(( $# - 1 )); _disttrain; echo "${{COMPREPLY[*]}}"; }}
complete_words disttrain tr
complete_words disttrain train --nproc_
complete_words disttrain bench weight
complete_words disttrain launch --rdzv-i
"""
    result = subprocess.run(["bash", "-c", probe.format(disttrain=" ".join(DISTTRAIN))], capture_output=True,
                            text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["train", "--nproc_per_node", "weight-sync", "--rdzv-id"]
    zsh = subprocess.run([*DISTTRAIN, "completion", "zsh"], capture_output=True, text=True, timeout=60)
    assert zsh.stdout.startswith("autoload -U +X bashcompinit") and "complete -o default -F _disttrain" in zsh.stdout
