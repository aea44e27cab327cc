"""The pipeline bubble benchmark: one real 2-rank run (its figures are reported, never asserted: the test checks
that each figure is the one its own measurements give) and bad input refused before anything starts."""

import csv
import json
import statistics

import pytest

from conftest import run_cli
from disttrain.cli.main import main


def test_bubble_rows_for_each_schedule_and_micro_batch_count(tmp_path):
    """gpipe and 1f1b (a stage a rank) and zero-bubble (two a rank, its backward split): each row's measured bubble
    from its own wall and stage times, the formula, and the schedule played with the measured stages (sends free,
    and each transfer a call as measured); at equal stages the played gpipe's is the formula's."""
    from disttrain.bench.pipeline import played

    out = tmp_path / "b"
    result = run_cli(["bench", "pipeline", "--schedules", "gpipe,1f1b,zero-bubble", "--microbatches", "2,4", "--micro",
                      "2", "--steps", "2", "--out", str(out)], tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr
    figures = json.loads((out / "pipeline.json").read_text())
    rows = figures["rows"]
    assert [(r["schedule"], r["microbatches"]) for r in rows] == [("gpipe", 2), ("gpipe", 4), ("1f1b", 2), ("1f1b", 4),
                                                                 ("zero-bubble", 2), ("zero-bubble", 4)]
    for r in rows:
        m, wall, v = r["microbatches"], r["schedule_s"], 2 if r["schedule"] == "zero-bubble" else 1
        assert r["stages"] == 2 and r["theoretical"] == pytest.approx(1 / (m + 1))  # (p-1)/(m+p-1), p = 2
        assert wall > 0 and [len(c) for c in r["stage_costs_s"]] == [v, v]
        assert r["stage_micro_s"] == pytest.approx([sum(s[0] + s[1] for s in c) for c in r["stage_costs_s"]])
        sizes = [len(s) for c in r["stage_costs_s"] for s in c]  # (a split backward's parts, but the first stage's)
        assert sizes == ([2, 4, 4, 4] if v == 2 else [2, 2])
        assert all(t > 0 for c in r["stage_costs_s"] for s in c for t in s)
        assert r["bubble_per_stage"] == pytest.approx([1 - m * t / wall for t in r["stage_micro_s"]])
        assert r["bubble"] == pytest.approx(statistics.fmean(r["bubble_per_stage"])) and r["bubble"] < 1
        assert r["played"] == pytest.approx(played(r["schedule"], 2, m, r["stage_costs_s"])) and 0 < r["played"] < 1
        assert r["transfer_s"] > 0 and r["played_with_transfers"] == pytest.approx(
            played(r["schedule"], 2, m, r["stage_costs_s"], r["transfer_s"])) and r["played_with_transfers"] < 1
    even = [[(1.0, 2.0)], [(1.0, 2.0)]]
    assert played("gpipe", 2, 4, even) == pytest.approx(1 / 5) and played("1f1b", 2, 4, even) == pytest.approx(1 / 5)
    assert played("zero-bubble", 2, 4, [[(0.5, 1.0)] * 2] * 2) < 1 / 5  # (its weight parts fill the bubble)
    # dualpipev: its overlapped forward-backward pairs run one after the other, as torch's runtime runs them; at equal
    # stages as zbv's V (the same stages on each rank)
    halves = [[(0.5, 1.0)] * 2] * 2
    assert played("dualpipev", 2, 4, halves) == pytest.approx(played("zbv", 2, 4, halves))
    assert played("dualpipev", 2, 8, halves) < played("1f1b", 2, 8, even)
    assert played("zero-bubble", 2, 4, [[(0.5, 1.0, 0.5, 0.5)] * 2] * 2) == pytest.approx(
        played("zero-bubble", 2, 4, [[(0.5, 1.0)] * 2] * 2))  # (parts measured as halves: the same)
    assert played("zero-bubble", 2, 4, [[(0.5, 1.0, 0.7, 0.7)] * 2] * 2) > played(
        "zero-bubble", 2, 4, [[(0.5, 1.0)] * 2] * 2)  # (parts costing more than the whole: idle for the work done)
    # a transfer a call on each computation that crosses ranks: 1f1b's 2 a micro-batch, on each rank's core
    assert played("1f1b", 2, 4, even, 0.5) == pytest.approx(1 - 4 * 3 / (5 * 3 + 5 * 2 * 0.5))
    with open(out / "pipeline.csv") as f:
        table = list(csv.DictReader(f))
    assert [float(t["bubble"]) for t in table] == pytest.approx([r["bubble"] for r in rows])
    md = (out / "pipeline.md").read_text()
    assert md.strip() in result.stdout
    assert "| gpipe | 2 | 4 |" in md and "| 1f1b | 2 | 2 |" in md and "| played |" in md and "torch " in md


@pytest.mark.parametrize("args, says", [
    (["--schedules", "dualpipe"], "--schedules dualpipe: use gpipe, 1f1b, interleaved-1f1b, zero-bubble, zbv, "
     "dualpipev"),
    (["--schedules", "dualpipev", "--microbatches", "2"], "'dualpipev' needs at least as many micro-batches per step "
     "as stages (4)"),
    (["--microbatches", "1,4"], "--microbatches 1: fewer micro-batches than the 2 stages"),
    (["--microbatches", "two"], "--microbatches 'two': give counts >= the 2 stages separated by commas"),
    (["--nproc", "1"], "--nproc 1: must be >= 2"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, says):
    code = main(["bench", "pipeline", "--out", str(tmp_path / "b"), *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("disttrain: error: ") and says in err and "\n" not in err, err
    assert not (tmp_path / "b").exists()
