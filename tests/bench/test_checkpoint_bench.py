"""Smoke test of the checkpoint benchmark (its figures are reported, never asserted)."""

import json

from disttrain.bench import checkpoint


def test_checkpoint_benchmark_runs_and_saves_its_figures(tmp_path, capsys):
    assert checkpoint.main(["--n-layer", "1", "--d-model", "64", "--rounds", "1", "--out", str(tmp_path)]) == 0
    figures = json.loads((tmp_path / "checkpoint.json").read_text())
    assert figures["save_vs_plain"] > 0 and figures["load_vs_plain"] > 0
    assert "async save blocks training" in capsys.readouterr().out
    assert not (tmp_path / "checkpoint_bench_files").exists()  # cleaned up
