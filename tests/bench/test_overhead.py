"""Smoke test of the overhead benchmark (its figures are reported, never asserted)."""

import json

from conftest import run_cli


def test_overhead_benchmark_runs_and_saves_its_figures(tmp_path):
    result = run_cli(["bench", "overhead", "--rounds", "2", "--steps", "1", "--out", str(tmp_path / "b")], tmp_path)
    assert result.returncode == 0, result.stderr
    figures = json.loads((tmp_path / "b" / "overhead.json").read_text())
    assert figures["ratio_disttrain_over_plain"] > 0 and figures["steps_per_loop"] == 2
    assert "ratio disttrain / plain" in result.stdout
