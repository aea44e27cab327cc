"""Smoke test of the overhead benchmark (its figures are reported, never asserted)."""

import json

from conftest import run_cli


def test_overhead_benchmark_runs_and_saves_its_figures(tmp_path):
    result = run_cli(["bench", "overhead", "--rounds", "2", "--steps", "1", "--strategies", "ddp,zero1,fsdp",
                      "--out", str(tmp_path / "b")], tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr
    figures = json.loads((tmp_path / "b" / "overhead.json").read_text())
    assert set(figures["strategies"]) == {"ddp", "zero1", "fsdp"} and figures["steps_per_loop"] == 2
    ddp = figures["strategies"]["ddp"]
    for row in figures["strategies"].values():  # each ratio is the one its own timings give (no timing asserted)
        assert row["plain_s"] > 0 and row["disttrain_s"] > 0
        assert row["ratio_vs_plain"] == row["disttrain_s"] / row["plain_s"]
        assert row["disttrain_vs_ddp"] == row["disttrain_s"] / ddp["disttrain_s"]
    assert "ratio disttrain / hand-written" in result.stdout
