"""`ddp` on 2 real processes (gloo) against the `single` reference, through the real CLI and torchrun."""

import json

import pytest

from conftest import read_metrics, run_cli
from disttrain.perf import comm_overlap

STEPS = 20


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same job (global batch 16) as 1 process x micro 16, and as 2 ranks x micro 4 x 2 accumulation."""
    tmp = tmp_path_factory.mktemp("ddp")
    common = ["--set", f"train.steps={STEPS}", "--set", "data.global_batch_size=16", "--set", "train.eval_every=10",
              "--set", "train.eval_samples=101", "--set", f"run.out_dir={tmp}", "--set", "model.n_layer=2",
              "--set", "model.d_model=64", "--set", "model.seq_len=32", "--set", "log.progress=false",
              "--set", "train.log_every=1"]
    single = run_cli(["train", "--nproc", "1", "--set", "run.name=single", "--set", "data.micro_batch_size=16",
                      *common], tmp)
    assert single.returncode == 0, single.stderr
    ddp = run_cli(["train", "--nproc", "2", "--set", "run.name=ddp", "--set", "data.micro_batch_size=4",
                   "--set", 'log.profile_steps="3-4"', *common], tmp)
    assert ddp.returncode == 0, ddp.stderr
    return tmp, single, ddp


def test_two_rank_ddp_matches_single_process_losses(runs):
    tmp, _, _ = runs
    single, ddp = read_metrics(tmp / "single"), read_metrics(tmp / "ddp")
    assert [m["step"] for m in single] == [m["step"] for m in ddp] == list(range(1, STEPS + 1))
    assert [m["loss"] for m in ddp] == pytest.approx([m["loss"] for m in single], abs=1e-5)
    assert [m["grad_norm"] for m in ddp] == pytest.approx([m["grad_norm"] for m in single], rel=1e-4)
    evals_single = {m["step"]: m["eval_loss"] for m in single if "eval_loss" in m}
    evals_ddp = {m["step"]: m["eval_loss"] for m in ddp if "eval_loss" in m}
    assert evals_single.keys() == evals_ddp.keys() == {10, 20}
    assert list(evals_ddp.values()) == pytest.approx(list(evals_single.values()), abs=1e-5)
    assert single[-1]["loss"] < single[0]["loss"] - 1.0


def test_run_dir_holds_resolved_config_and_metrics(runs):
    tmp, _, ddp = runs
    config = (tmp / "ddp" / "config.toml").read_text()
    assert 'strategy = "ddp"' in config and "nproc = 2" in config
    for record in read_metrics(tmp / "ddp"):
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s"} <= record.keys()
        assert record["tokens"] == 16 * 32
    assert "torchrun --nnodes 1 --nproc-per-node 2" in ddp.stderr  # the equivalent command is printed
    assert not list(tmp.glob("torchelastic_*"))  # torchrun's temp folders stay inside the run dir


def test_every_line_carries_the_cost_of_the_step(runs):
    tmp, _, _ = runs
    single, ddp = read_metrics(tmp / "single"), read_metrics(tmp / "ddp")
    for record in ddp:
        assert record["comm_s"] > 0 and 0 <= record["comm_exposed_s"] <= record["comm_s"] < record["step_time_s"]
        assert record["comm_bytes"] > 0 and record["slowest_rank"] in (0, 1) and record["slowest_ratio"] >= 1
        assert record["step_time_max_s"] >= record["step_time_s"] >= record["work_s"] > 0
        assert record["mem_peak_gib_max"] >= record["mem_peak_gib"] > 0
        assert record["mfu"] is None and record["tflops"] > 0  # no peak is known for a CPU
    assert [r["step"] for r in ddp] == list(range(1, STEPS + 1))  # every step's line, in order
    for record in single:
        assert record["comm_s"] is None and record["slowest_rank"] == 0  # nothing to communicate
    # the same model and tokens: the same FLOPs per token, so TFLOP/s and tokens/s keep one ratio in both runs
    ratios = [r["tflops"] / r["tokens_per_s"] for r in single + ddp]
    assert max(ratios) / min(ratios) == pytest.approx(2.0, rel=1e-6)  # per device: 2 ranks share the tokens


def test_profile_steps_write_a_trace_per_rank(runs):
    tmp, single, _ = runs
    for rank in (0, 1):
        trace = json.loads((tmp / "ddp" / "profile" / f"rank{rank}.json").read_text())
        names = {event.get("name", "") for event in trace["traceEvents"]}
        assert "aten::mm" in names or "aten::addmm" in names
        assert any("all_reduce" in name or "allreduce" in name for name in names)  # DDP's gradient buckets
        assert comm_overlap(trace, 2) is None  # no kernels on a CPU: the step meter measured exposure itself
    assert {p.name for p in (tmp / "ddp" / "profile").iterdir()} == {"rank0.json", "rank1.json"}
    assert not (tmp / "single" / "profile").exists()


def test_a_static_graph_trains_one_micro_batch_per_step_and_refuses_to_accumulate(tmp_path):
    """torch's DDP crashes under no_sync with static_graph (pytorch/pytorch#143580): the config refuses it (exit 2,
    one line, before any rank starts) and the backend's no_sync does too (a loop of one's own, the service);
    with one micro-batch per step the static graph trains."""
    refused = run_cli(["train", "--set", "parallel.strategy=ddp", "--set", "parallel.static_graph=true",
                       "--set", f"run.out_dir={tmp_path}"], tmp_path, timeout=120)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and "data.micro_batch_size = 32" in refused.stderr
    assert not (tmp_path / "default").exists()

    import torch

    from disttrain.backend import create_backend
    from disttrain.bench.gpu.kit import runtime as one_rank_runtime
    from disttrain.config import ConfigError, load_config
    from disttrain.models.gpt import GPT
    from disttrain.optim import optimizer_factory

    cfg = load_config(None, ["parallel.strategy=ddp", "parallel.static_graph=true", "model.n_layer=1",
                             "model.d_model=32", "model.seq_len=16"])
    backend = create_backend(GPT(cfg.model), optimizer_factory(cfg.optim), cfg.parallel,
                             runtime=one_rank_runtime(torch.device("cpu"), group=True))
    x = torch.randint(0, cfg.model.vocab_size, (2, 16))
    losses = []
    for _ in range(3):
        backend.forward_backward({"input_ids": x, "labels": x})
        losses.append(backend.optim_step()["loss"])
    assert losses[-1] < losses[0]
    with pytest.raises(ConfigError, match="static_graph"):
        backend.forward_backward({"input_ids": x, "labels": x}, sync=False)
    backend.forward_backward({"input_ids": x, "labels": x})  # nothing was left half-done: training goes on
    assert backend.optim_step()["loss"] < losses[0]
