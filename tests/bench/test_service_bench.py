"""Smoke test of the service benchmark (its figures are reported, never asserted)."""

import json

from disttrain.bench import service


def test_service_benchmark_runs_and_saves_its_figures(tmp_path):
    assert service.main(["--repeats", "1", "--steps", "4", "--warmup", "1", "--out", str(tmp_path)]) == 0
    figures = json.loads((tmp_path / "service.json").read_text())
    assert len(figures["train_ms"]) == len(figures["service_ms"]) == 1 and figures["median_ratio"] > 0
    assert "median ratio" in (tmp_path / "service.md").read_text()
