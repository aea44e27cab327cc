"""Every strategy on 2 real ranks (gloo) against the single-process reference, with and without activation
checkpointing. One launch trains all variants in one process group (start-up is shared)."""

import json
import subprocess
import sys

import pytest

from conftest import SCRIPTS, cli_env, run_cli

VARIANTS = ["ddp", "zero1", "zero2", "fsdp", "zero3", "hsdp:1", "hsdp:2"]  # hsdp:N = shard groups of N ranks
# options, each once (FSDP2 CPUOffloadPolicy runs on CPU without pinned memory; explicit prefetch of N blocks)
OPTIONS = ["fsdp+offload", "zero2+offload", "hsdp+offload:1", "fsdp+prefetch2", "zero2+prefetch1"]


def with_ac(variant: str) -> str:
    """`hsdp:1` -> `hsdp+ac:1`: the same variant with activation checkpointing."""
    strategy, colon, shard = variant.partition(":")
    return f"{strategy}+ac{colon}{shard}"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("strategies")
    script = str(SCRIPTS / "strategy_parity.py")
    single = subprocess.run([sys.executable, script, str(tmp), "single", "single+ac"], cwd=tmp, env=cli_env(tmp),
                            capture_output=True, text=True, timeout=120)
    assert single.returncode == 0, single.stderr
    variants = VARIANTS + [with_ac(v) for v in VARIANTS] + OPTIONS
    multi = run_cli(["launch", "--nproc", "2", "--run-dir", str(tmp / "launch"), script, str(tmp), *variants], tmp,
                    timeout=300)
    assert multi.returncode == 0, multi.stderr
    return json.loads((tmp / "1.json").read_text()), json.loads((tmp / "2.json").read_text())


def test_activation_checkpointing_does_not_change_the_numbers(results):
    one, _ = results
    assert one["single+ac"]["losses"] == pytest.approx(one["single"]["losses"], abs=1e-6)
    assert one["single"]["losses"][-1] < one["single"]["losses"][0] - 1.0


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("ac", [False, True])
def test_strategy_matches_single_process(results, variant, ac):
    one, two = results
    got, reference = two[with_ac(variant) if ac else variant], one["single"]
    assert len(got["losses"]) == 20
    assert got["losses"] == pytest.approx(reference["losses"], abs=1e-5)
    assert got["eval"].keys() == reference["eval"].keys() == {"10", "20"}
    for step in reference["eval"]:  # 33 eval samples: uneven shards, sharded forward on every rank
        assert got["eval"][step] == pytest.approx(reference["eval"][step], abs=1e-5)


@pytest.mark.parametrize("variant", OPTIONS)
def test_offload_and_prefetch_match_single_process(results, variant):
    one, two = results
    assert two[variant]["losses"] == pytest.approx(one["single"]["losses"], abs=1e-5)
    for step in one["single"]["eval"]:
        assert two[variant]["eval"][step] == pytest.approx(one["single"]["eval"][step], abs=1e-5)
