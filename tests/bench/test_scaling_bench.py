"""The scaling benchmark: one real run at world sizes 1 and 2 (its figures are reported, never asserted: the test
checks that each figure is the one its own measurements give) and bad input refused before anything starts."""

import csv
import importlib.util
import json
import math
import os

import pytest

from conftest import run_cli
from disttrain.cli.main import main

TINY = ["--set", "model.n_layer=1", "--set", "model.d_model=32", "--set", "model.n_head=2", "--set", "model.seq_len=16",
        "--set", "data.global_batch_size=8", "--set", "data.micro_batch_size=4", "--set", "train.eval_samples=16"]


def test_scaling_benchmark_rows_hand_written_loop_and_sweep(tmp_path, capsys):
    out = tmp_path / "b"
    result = run_cli(["bench", "scaling", "--strategies", "ddp", "--world-sizes", "1,2", "--mode", "weak",
                      "--sweep", "parallel.bucket_cap_mb=1,25", "--steps", "1", "--rounds", "2", "--eval-steps", "2",
                      "--out", str(out), *TINY], tmp_path, timeout=180)
    assert result.returncode == 0, result.stderr
    with open(out / "scaling.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted((r["loop"], r["world_size"], r["sweep_value"]) for r in rows) == sorted(
        (loop, w, v) for loop in ("disttrain", "hand-written") for w in ("1", "2") for v in ("1", "25"))
    tps = {(r["loop"], r["sweep_value"], int(r["world_size"])): float(r["tokens_per_s"]) for r in rows}
    for r in rows:
        w, key = int(r["world_size"]), (r["loop"], r["sweep_value"])
        assert r["strategy"] == "ddp" and r["mode"] == "weak" and r["sweep_key"] == "parallel.bucket_cap_mb"
        assert int(r["global_batch"]) == 8 * w and int(r["micro_batch"]) == 4  # weak: the batch per rank is fixed
        assert float(r["tokens_per_s"]) == pytest.approx(8 * w * 16 / float(r["step_time_s"]))
        assert float(r["tokens_per_s_per_rank"]) == pytest.approx(float(r["tokens_per_s"]) / w)
        efficiency = tps[(*key, w)] / (w * tps[(*key, 1)])
        assert float(r["efficiency"]) == pytest.approx(efficiency)
        assert float(r["target"]) == 0.9 and r["result"] == ("PASS" if efficiency >= 0.9 else "FAIL")
        if r["loop"] == "disttrain":
            plain = tps[("hand-written", r["sweep_value"], w)] / (w * tps[("hand-written", r["sweep_value"], 1)])
            assert float(r["efficiency_vs_hand_written"]) == pytest.approx(efficiency / plain)
            assert float(r["mem_peak_gib"]) > 0 and math.isfinite(float(r["eval_loss"]))
        else:
            assert math.isnan(float(r["eval_loss"])) and math.isnan(float(r["efficiency_vs_hand_written"]))
    # the fixed run is the same for every sweep value: the bucket size does not change what is computed
    losses = {(r["world_size"], r["sweep_value"]): float(r["eval_loss"]) for r in rows if r["loop"] == "disttrain"}
    for w in ("1", "2"):
        assert losses[w, "1"] == pytest.approx(losses[w, "25"], rel=1e-5)
    # the model's size in every row: `bench predict --validate` checks a CSV against the model it is given
    from disttrain.config import load_config
    from disttrain.models import build_model

    params = sum(p.numel() for p in build_model(load_config(None, TINY[1::2]).model).parameters())
    assert {r["params"] for r in rows} == {str(params)} and {r["trained_params"] for r in rows} == {str(params)}
    fit = {"backend": "gloo", "world_size": 2, "device": "cpu", "collectives": {
        c: {"alpha_s": 1e-3, "beta_s_per_byte": 1e-9} for c in ("all_reduce", "all_gather", "reduce_scatter")}}
    (tmp_path / "comm_fit.json").write_text(json.dumps(fit))
    check = ["bench", "predict", "--validate", "--measured", str(out / "scaling.csv"), "--interconnect",
             f"measured:{tmp_path}", "--out", str(tmp_path / "p")]
    assert main([*check, *TINY]) == 0
    assert "| ddp weak disttrain parallel.bucket_cap_mb 1 | 2 |" in (tmp_path / "p" / "predict.md").read_text()
    capsys.readouterr()
    assert main([*check, *TINY, "--set", "model.d_model=64"]) == 2  # another model: refused in one line
    assert "was measured on a model of" in capsys.readouterr().err
    md = (out / "scaling.md").read_text()
    assert md.strip() in result.stdout
    assert "disttrain's ddp against the hand-written DDP loop" in md
    assert "| ddp | hand-written | bucket_cap_mb=1 |" in md
    assert "Machine:" in md and "torch " in md and "[model]" in md
    if importlib.util.find_spec("matplotlib"):
        assert (out / "efficiency.png").stat().st_size > 0 and (out / "throughput.png").stat().st_size > 0
    else:
        assert "pip install 'disttrain[plot]'" in md


CORES = len(os.sched_getaffinity(0))


@pytest.mark.parametrize("args, says", [
    (["--strategies", "ddp,zero9"], "parallel.strategy = 'zero9' is not known"),
    (["--world-sizes", f"1,{4 * CORES + 1}"], "more than this machine can start"),
    (["--world-sizes", "2,4"], "must include 1"),
    (["--sweep", "parallel.bucket_cap=1,25"], "unknown setting 'parallel.bucket_cap': did you mean 'bucket_cap_mb'"),
    (["--strategies", "fsdp", "--sweep", "parallel.bucket_cap_mb=1,25"], "none of --strategies fsdp reads it"),
    (["--mode", "medium"], "--mode medium: use weak"),
    (["--mode", "strong", "--world-sizes", "1,3", "--set", "data.global_batch_size=8"],
     "not divisible by world size 3"),
    (["--set", "data.global_batch_size=6", "--set", "data.micro_batch_size=4"], "not divisible by data.micro_batch"),
    (["--set", "data.micro_batch_size=0"], "data.micro_batch_size = 0: must be > 0"),
    (["--mode", "strong", "--set", "data.global_batch_size=0"], "data.global_batch_size = 0: must be > 0"),
    (["--out", "a_file"], "--out '"),
])
def test_bad_input_is_one_line_and_exit_2_before_anything_starts(tmp_path, capsys, monkeypatch, args, says):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_file").write_text("")  # (an --out that cannot be a folder)
    code = main(["bench", "scaling", "--out", str(tmp_path / "b"), *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("disttrain: error: ") and says in err and "\n" not in err, err
    assert not (tmp_path / "b").exists()


def test_row_batches_follow_the_mode():
    from disttrain.bench.scaling import base_config, row_config

    base = base_config(None, ["data.global_batch_size=24", "data.micro_batch_size=4"])
    weak = row_config(base, "ddp", "", "", "weak", 3)
    assert (weak.data.global_batch_size, weak.data.micro_batch_size) == (72, 4)
    for world, micro in ((1, 4), (2, 4), (3, 4), (4, 3), (8, 3), (12, 2), (24, 1)):  # 24 / world per rank
        strong = row_config(base, "fsdp", "", "", "strong", world)
        assert (strong.data.global_batch_size, strong.data.micro_batch_size) == (24, micro)
    swept = row_config(base, "ddp", "parallel.bucket_cap_mb", "1", "weak", 1)
    assert swept.parallel.bucket_cap_mb == 1.0 and swept.parallel.strategy == "ddp" and base.parallel.strategy == "auto"


def test_report_assembles_repeats_and_compares_ddp_with_its_own_hand_written_loop():
    from disttrain.bench.scaling_report import _versus_hand_written, assemble

    def row(strategy, loop, world, step_time, mem=0.5):
        return {"strategy": strategy, "loop": loop, "mode": "weak", "world_size": world, "sweep_key": "",
                "sweep_value": "", "global_batch": 8 * world, "micro_batch": 4, "seq_len": 16,
                "step_time_s": step_time, "mem_peak_gib": mem if loop == "disttrain" else math.nan}

    launches = [row("ddp", "disttrain", 1, 1.0), row("ddp", "hand-written", 1, 1.25), row("fsdp", "disttrain", 1, 2.0),
                row("ddp", "disttrain", 2, 2.0), row("ddp", "hand-written", 2, 2.0), row("fsdp", "disttrain", 2, 8.0),
                row("ddp", "disttrain", 2, 1.0, mem=0.75), row("ddp", "disttrain", 2, 1.5)]  # 3 launches at 2 ranks
    rows = assemble(launches, "weak", cuda=False, cores=1)
    by = {(r["strategy"], r["loop"], r["world_size"]): r for r in rows}
    assert len(rows) == 6 and by["ddp", "disttrain", 2]["launches"] == 3
    ddp = by["ddp", "disttrain", 2]
    assert ddp["step_time_s"] == 1.5 and ddp["mem_peak_gib"] == 0.75  # median step time, max memory
    assert ddp["efficiency"] == pytest.approx(2 / 3) and ddp["result"] == "FAIL" and ddp["oversubscribed"]
    assert by["ddp", "hand-written", 2]["efficiency"] == pytest.approx(0.625)
    assert ddp["efficiency_vs_hand_written"] == pytest.approx((2 / 3) / 0.625)
    assert by["fsdp", "disttrain", 2]["efficiency"] == pytest.approx(0.25)
    assert math.isnan(by["fsdp", "disttrain", 2]["efficiency_vs_hand_written"])
    line = _versus_hand_written(rows)[-1]  # speeds: 1.25 at 1 rank, 2 / 1.5 at 2 (fsdp's rows left out)
    assert line == f"|  | 2 | 0.667 | 0.625 | **{(2 / 3) / 0.625:.3f}** | >= 0.98 | PASS | 1.250 | 1.333 |"


def test_step_stats_read_the_steps_keys_when_they_report_them():
    from disttrain.bench.scaling import step_stats

    plain = [{"loss": 1.0, "step_time_s": 0.2, "comm_exposed_s": None, "comm_bytes": None, "mfu": None}] * 3
    assert [math.isnan(x) for x in step_stats(plain, 0.4)[:3]] == [True] * 3  # e.g. one process: nothing timed
    timed = [{"step_time_s": t, "comm_exposed_s": e, "comm_bytes": b, "mfu": 0.3}
             for t, e, b in ((0.2, 0.05, 100), (0.4, 0.04, 300), (0.1, 0.05, 200))]
    assert step_stats(timed, 2.0) == [0.25, 200, 0.3, 2.0]


def test_a_setting_some_strategies_read_is_no_reason_to_refuse_the_base_config():
    from disttrain.bench.scaling import _args, make_plan

    plan = make_plan(_args(["--strategies", "ddp", "--world-sizes", "1,2", "--set", "parallel.bucket_cap_mb=1"]))
    assert plan.strategies == ["ddp"] and plan.base.parallel.bucket_cap_mb == 1  # ('auto' at 1 rank reads none)
