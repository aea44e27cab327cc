"""`disttrain verify`: the user's job under several strategies against the 1-process reference."""

import pytest

from conftest import run_cli

SMALL = ["--set", "model.n_layer=2", "--set", "model.d_model=64", "--set", "model.seq_len=32", "--steps", "6"]


def test_verify_passes_when_every_strategy_matches(tmp_path):
    entries = ("ddp", "fsdp", "hsdp", "tp2", "pp2+gpipe")  # the model split tensor-wise and stage-wise too
    result = run_cli(["verify", *SMALL, "--strategies", ",".join(entries)], tmp_path)
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line for line in result.stdout.splitlines()[1:]}
    assert set(rows) == {"single", *entries}
    assert all(rows[s].endswith("ok") for s in entries)
    for s in entries:  # loss, grad norm and final parameters (every stage's) were each compared
        _, steps, loss, norm, params, _, _ = rows[s].split()
        assert steps == "6" and all(0.0 <= float(v) <= 1e-5 for v in (loss, norm, params))


def test_verify_offers_the_layouts_the_model_allows():
    from disttrain.cli.verify import _layouts
    from disttrain.config import load_config

    assert _layouts(load_config(None, ["model.n_layer=2"]), 2) == ["tp2", "pp2", "cp2"]
    # 1 block cannot fill 2 stages, 3 heads do not split over 2 ranks, 127 tokens do not cut in 2 chunks
    assert _layouts(load_config(None, ["model.n_layer=1", "model.n_head=3", "model.d_model=96",
                                       "model.seq_len=127"]), 2) == []


@pytest.mark.parametrize("extra", [["--set", "model.dropout=0.2"]])
def test_verify_fails_when_ranks_cannot_match(tmp_path, extra):
    """Dropout draws different masks per rank: the numbers cannot match, and verify must say so."""
    result = run_cli(["verify", *SMALL, "--strategies", "ddp", *extra], tmp_path)
    assert result.returncode == 1
    assert "DIFFERS (tolerance 1e-05)" in result.stdout
    _, _, loss, norm, params, _, _, _, _ = result.stdout.splitlines()[2].split()
    assert float(norm) > 1e-5 and float(params) > 1e-5


def test_verify_rejects_a_bad_strategy_before_starting(tmp_path):
    result = run_cli(["verify", *SMALL, "--strategies", "ddp,fsdpp"], tmp_path)
    assert result.returncode == 2 and "did you mean 'fsdp'" in result.stderr
    assert not (tmp_path / "runs").exists()


def test_verify_rejects_a_bad_layout_before_starting(tmp_path):
    result = run_cli(["verify", *SMALL, "--strategies", "fsdp+tp2+fast"], tmp_path)
    assert result.returncode == 2 and "'fast' in 'fsdp+tp2+fast' is not tpN, ppN, cpN, sp" in result.stderr
    assert result.stderr.strip().count("\n") == 0
