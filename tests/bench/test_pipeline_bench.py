"""The pipeline bubble benchmark: one real 2-stage run (its figures are reported, never asserted: the test checks
that each figure is the one its own measurements give) and bad input refused before anything starts."""

import csv
import json
import statistics

import pytest

from conftest import run_cli
from disttrain.cli.main import main


def test_bubble_rows_for_each_schedule_and_micro_batch_count(tmp_path):
    out = tmp_path / "b"
    result = run_cli(["bench", "pipeline", "--schedules", "gpipe,1f1b", "--microbatches", "2,4", "--micro", "2",
                      "--steps", "2", "--out", str(out)], tmp_path, timeout=180)
    assert result.returncode == 0, result.stderr
    figures = json.loads((out / "pipeline.json").read_text())
    rows = figures["rows"]
    assert [(r["schedule"], r["microbatches"]) for r in rows] == [("gpipe", 2), ("gpipe", 4), ("1f1b", 2), ("1f1b", 4)]
    for r in rows:
        m, wall = r["microbatches"], r["schedule_s"]
        assert r["stages"] == 2 and r["theoretical"] == pytest.approx(1 / (m + 1))  # (p-1)/(m+p-1), p = 2
        assert wall > 0 and len(r["stage_micro_s"]) == 2 and all(t > 0 for t in r["stage_micro_s"])
        assert r["bubble_per_stage"] == pytest.approx([1 - m * t / wall for t in r["stage_micro_s"]])
        assert r["bubble"] == pytest.approx(statistics.fmean(r["bubble_per_stage"])) and r["bubble"] < 1
    with open(out / "pipeline.csv") as f:
        table = list(csv.DictReader(f))
    assert [float(t["bubble"]) for t in table] == pytest.approx([r["bubble"] for r in rows])
    md = (out / "pipeline.md").read_text()
    assert md.strip() in result.stdout
    assert "| gpipe | 2 | 4 |" in md and "| 1f1b | 2 | 2 |" in md and "| theoretical |" in md and "torch " in md


@pytest.mark.parametrize("args, says", [
    (["--schedules", "interleaved-1f1b"], "--schedules interleaved-1f1b: use gpipe or 1f1b"),
    (["--microbatches", "1,4"], "--microbatches 1: fewer micro-batches than the 2 stages"),
    (["--microbatches", "two"], "--microbatches 'two': give counts >= the 2 stages separated by commas"),
    (["--nproc", "1"], "--nproc 1: must be >= 2"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, says):
    code = main(["bench", "pipeline", "--out", str(tmp_path / "b"), *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("disttrain: error: ") and says in err and "\n" not in err, err
    assert not (tmp_path / "b").exists()
