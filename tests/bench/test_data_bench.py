"""Smoke test of the data benchmark (its figures are reported, never asserted)."""

import json

from conftest import run_cli


def test_data_benchmark_runs_and_saves_its_figures(tmp_path):
    result = run_cli(["bench", "data", "--rounds", "2", "--steps", "2", "--out", str(tmp_path / "b")], tmp_path,
                     timeout=240)
    assert result.returncode == 0, result.stderr
    figures = json.loads((tmp_path / "b" / "data_loader.json").read_text())
    med = figures["median_step_s"]
    assert set(med) == {"direct", "loader", "slow", "slow_workers"} and figures["steps_timed_per_variant"] == 2
    assert figures["ratio_loader_over_direct"] == med["loader"] / med["direct"]
    assert figures["ratio_workers_over_none"] == med["slow_workers"] / med["slow"]
    assert "DataLoader (0 workers) / direct fetch" in result.stdout
