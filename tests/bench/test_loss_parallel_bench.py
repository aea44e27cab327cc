"""The loss-parallel benchmark: one real tp2 launch (its times are reported, never asserted; the test checks each
row's ratio is its own two times') and bad input refused before anything starts."""

import json

import pytest

from conftest import run_cli
from disttrain.cli.main import main


def test_rows_for_each_vocabulary(tmp_path):
    out = tmp_path / "b"
    result = run_cli(["bench", "loss-parallel", "--vocabs", "256,1024", "--micro", "2", "--steps", "2",
                      "--out", str(out)], tmp_path, timeout=180)
    assert result.returncode == 0, result.stderr
    rows = json.loads((out / "loss_parallel.json").read_text())["rows"]
    assert [r["vocab"] for r in rows] == [256, 1024]
    for r in rows:
        assert r["gathered_ms"] > 0 and r["split_ms"] > 0
        assert r["ratio"] == pytest.approx(r["split_ms"] / r["gathered_ms"])
    md = (out / "loss_parallel.md").read_text()
    assert md.strip() in result.stdout and f"| 1024 | {rows[1]['gathered_ms']:.1f} |" in md


@pytest.mark.parametrize("vocabs", ["255", "257", "many", ""])
def test_bad_vocabularies_are_one_line(tmp_path, capsys, vocabs):
    assert main(["bench", "loss-parallel", "--vocabs", vocabs, "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--vocabs" in err and "divisible by --nproc 2" in err
    assert not (tmp_path / "b").exists()
