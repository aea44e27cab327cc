"""`disttrain bench memory`'s refusals (its measurements against the estimator: tests/test_memory.py)."""

import pytest

from disttrain.cli.main import main


@pytest.mark.parametrize("args, says", [
    (["--world-sizes", "a"], "--world-sizes 'a': give world sizes 1.."),
    (["--world-sizes", "0"], "--world-sizes '0': give world sizes 1.."),
    (["--world-sizes", "1,100000"], "--world-sizes '1,100000': give world sizes 1.."),
    (["--layouts", "tp2,pp9"], "--layouts pp9: not known; choose from tp2"),
    (["--strategies", "ddp,zero9"], "--strategies 'ddp,zero9': zero9 not known; choose from"),
    (["--strategies", ","], "--strategies ',': names none"),
    (["--micro", "0"], "--micro 0: must be >= 1"),
])
def test_bad_input_is_one_line_and_exit_2_before_anything_starts(tmp_path, capsys, args, says):
    code = main(["bench", "memory", "--out", str(tmp_path / "b"), *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("disttrain: error: " + says) and "\n" not in err, err
    assert not (tmp_path / "b").exists()
