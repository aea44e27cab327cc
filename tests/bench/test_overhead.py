"""Smoke test of the overhead benchmark (its figures are reported, never asserted)."""

import json

import pytest

from conftest import SCRIPTS, run_cli
from disttrain.cli.main import main


def test_overhead_benchmark_runs_and_saves_its_figures(tmp_path):
    result = run_cli(["bench", "overhead", "--rounds", "2", "--steps", "1", "--strategies", "ddp,zero1,fsdp",
                      "--profile", "1", "--set", "model.d_model=64", "--set", "model.n_head=2", "--out",
                      str(tmp_path / "b")], tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr
    assert "GPT 4 layers, d_model 64, seq_len 64" in result.stdout  # the job as --set changed it
    figures = json.loads((tmp_path / "b" / "overhead.json").read_text())
    assert set(figures["strategies"]) == {"ddp", "zero1", "fsdp"} and figures["steps_per_loop"] == 2
    ddp = figures["strategies"]["ddp"]
    for row in figures["strategies"].values():  # each ratio is the one its own timings give (no timing asserted)
        assert row["plain_s"] > 0 and row["disttrain_s"] > 0
        assert row["ratio_vs_plain"] == row["disttrain_s"] / row["plain_s"]
        assert row["disttrain_vs_ddp"] == row["disttrain_s"] / ddp["disttrain_s"]
        assert row["bare_s"] > 0 and row["figures_cost"] == row["disttrain_s"] / row["bare_s"]
    assert "ratio disttrain / hand-written" in result.stdout and "| the figures' cost |" in result.stdout
    for strategy, profile in figures["profile"].items():  # where rank 0's time goes, after the timed rounds
        assert profile["profiled, per step (hand-written / disttrain)"].endswith("1 steps each, built first and built "
                                                                                 "second"), profile
        assert len(profile["host time per step, the operators that differ most (hand-written / disttrain, us; "
                           "calls)"].split("; ")) == 8
        assert f"## Where {strategy}'s time goes (rank 0, profiled)" in result.stdout
    assert list(figures["profile"]) == ["ddp", "zero1", "fsdp"]


def test_model_parallel_layouts_run_against_their_hand_written_loops(tmp_path):
    result = run_cli(["bench", "overhead", "--rounds", "2", "--steps", "1", "--strategies", "pp2,pp2-gpipe,tp2",
                      "--micro", "4", "--global-batch", "8", "--profile", "1", "--out", str(tmp_path / "b")], tmp_path,
                     timeout=240)
    assert result.returncode == 0, result.stderr
    figures = json.loads((tmp_path / "b" / "overhead.json").read_text())
    assert list(figures["strategies"]) == ["pp2", "pp2-gpipe", "tp2"] and figures["steps_per_loop"] == 2
    assert list(figures["profile"]) == ["pp2", "pp2-gpipe", "tp2"]  # the layouts' loops profile too
    for row in figures["strategies"].values():
        assert row["plain_s"] > 0 and row["disttrain_s"] > 0
        assert row["ratio_vs_plain"] == row["disttrain_s"] / row["plain_s"]
    md = (tmp_path / "b" / "overhead.md").read_text()
    for name in ("pp2", "pp2-gpipe", "tp2"):
        assert f"| {name} | " in md
    assert "ppN = parallel.pipeline = N (schedule 1f1b" in md and "Schedule1F1B" in md and "ColwiseParallel" in md


@pytest.mark.parametrize("strategies, says", [
    ("ddp,pp", "--strategies pp: unknown; use a strategy (single, ddp"),
    ("tp2-gpipe", "or a layout over all ranks: pp2, pp2-gpipe, tp2"),
    ("pp4", "--strategies pp4: the layout's degree 4 must equal --nproc 2"),
    ("", "--strategies is empty"),
    ("ddp --rounds 3", "--rounds 3: must be even"),
    ("ddp --steps 0", "--steps 0: must be >= 1"),
    ("ddp --nproc 1000", "--nproc 1000: more ranks than this machine can start"),
    ("ddp --profile -1", "--profile -1: must be >= 0"),
    ("ddp --set data.micro_batch_size=2", "--set data.micro_batch_size=2: the bench cannot take "
                                          "data.micro_batch_size (use --micro); leave it out"),
    ("ddp --set optim.name=sgd", "the bench cannot take optim.name (the hand-written loops use AdamW)"),
    ("ddp --set parallel.precision=bf16-mixed", "--set parallel.precision=bf16-mixed: the hand-written loops would "
                                                "not follow parallel.precision; --set takes model.*, data.*"),
    ("tp2 --set optim.grad_clip=1.0", "--set optim.grad_clip=1.0: --strategies tp2 sets it"),
    ("ddp --set model.d_model=30", "model.d_model = 30 is not divisible by model.n_head = 4"),
    ("ddp --set model.d_model", "--set 'model.d_model': expected section.key=value"),
])
def test_unknown_layout_is_one_line_and_exit_2(tmp_path, capsys, strategies, says):
    strategies, *more = strategies.split(" ")
    code = main(["bench", "overhead", "--strategies", strategies, *more, "--out", str(tmp_path / "b")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("disttrain: error: ") and says in err and "\n" not in err, err
    assert not (tmp_path / "b").exists()


def test_layout_settings():
    from disttrain.bench.overhead import settings

    assert settings("fsdp") == ["parallel.strategy=fsdp"]
    assert settings("pp2") == ["parallel.strategy=ddp", "optim.grad_clip=0", "parallel.pipeline=2",
                               "parallel.pipeline_schedule=1f1b"]
    assert settings("pp4-gpipe")[-1] == "parallel.pipeline_schedule=gpipe"
    assert settings("tp2") == ["parallel.strategy=ddp", "optim.grad_clip=0", "parallel.tensor=2"]


def test_hand_written_model_parallel_loops_train_like_one_process(tmp_path):
    """The references are right: the hand-written 1f1b, GPipe and tensor-parallel loops give the losses of the same
    GPT, data and AdamW in one process, step by step."""
    result = run_cli(["launch", "--fork", "--nproc", "2", "--run-dir", str(tmp_path / "launch"),
                      str(SCRIPTS / "plain_model_parallel_job.py"), str(tmp_path)], tmp_path, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = json.loads((tmp_path / "losses.json").read_text())
    reference = losses.pop("one process")
    assert len(reference) == 4 and reference[3] < reference[0]
    for name, values in losses.items():
        assert values == pytest.approx(reference, rel=1e-5), name
    # bench scaling's GPU job is bf16-mixed: the hand-written ddp / fsdp loops follow it as disttrain does (autocast;
    # FSDP2 gathering in bf16), nearer disttrain's bf16 losses than their own fp32 losses are
    precision = json.loads((tmp_path / "precision.json").read_text())
    for strategy in ("ddp", "fsdp"):
        names = ("bf16-mixed disttrain", "bf16-mixed hand-written", "fp32 hand-written")
        ours, hand, fp32 = (precision[f"{strategy} {name}"] for name in names)
        apart = max(abs(a - b) for a, b in zip(ours, hand, strict=True))
        bf16_cost = max(abs(a - b) for a, b in zip(ours, fp32, strict=True))
        assert apart < bf16_cost / 10 and bf16_cost > 1e-6, (strategy, precision)
