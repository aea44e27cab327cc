"""Every strategy on 2 real ranks (gloo) against the single-process run and against an independent
plain-torch loop (tests/scripts/plain_reference.py): per-step loss, grad norm and the final parameters,
under AdamW with clipping, AdamW without clipping and SGD without clipping (where a wrong gradient scale
cannot hide behind the clip or Adam's scale invariance). One launch trains all variants in one process
group (start-up is shared)."""

import json
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from conftest import SCRIPTS, cli_env, run_cli

sys.path.insert(0, str(SCRIPTS))
from plain_reference import Reference, compare  # noqa: E402

VARIANTS = ["ddp", "zero1", "zero2", "fsdp", "zero3", "hsdp:1", "hsdp:2"]  # hsdp:N = shard groups of N ranks
# options, each once (FSDP2 CPUOffloadPolicy runs on CPU without pinned memory; explicit prefetch of N blocks)
OPTIONS = ["fsdp+offload", "zero2+offload", "hsdp+offload:1", "fsdp+prefetch2", "zero2+prefetch1"]
# optimizers against the plain loop: "" = AdamW with grad_clip 1.0 (the job's default)
OPTIMIZERS = ["", "+noclip", "+sgd+noclip"]
UNCLIPPED = ["ddp+sgd+noclip", "zero1+sgd+noclip", "zero2+sgd+noclip", "fsdp+sgd+noclip", "hsdp+sgd+noclip:1",
             "ddp+noclip", "fsdp+noclip", "hsdp+noclip:1"]


def optimizer_of(variant: str) -> str:
    return "".join(f"+{flag}" for flag in ("sgd", "noclip") if f"+{flag}" in variant)


def with_ac(variant: str) -> str:
    """`hsdp:1` -> `hsdp+ac:1`: the same variant with activation checkpointing."""
    strategy, colon, shard = variant.partition(":")
    return f"{strategy}+ac{colon}{shard}"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("strategies")
    script = str(SCRIPTS / "strategy_parity.py")
    one_process = ["single", "single+ac", *(f"single{o}" for o in OPTIMIZERS[1:]), *(f"plain{o}" for o in OPTIMIZERS)]
    single = subprocess.run([sys.executable, script, str(tmp), *one_process], cwd=tmp, env=cli_env(tmp),
                            capture_output=True, text=True, timeout=180)
    assert single.returncode == 0, single.stderr
    variants = VARIANTS + [with_ac(v) for v in VARIANTS] + OPTIONS + UNCLIPPED
    multi = run_cli(["launch", "--nproc", "2", "--run-dir", str(tmp / "launch"), script, str(tmp), *variants], tmp,
                    timeout=400)
    assert multi.returncode == 0, multi.stderr
    one, two = json.loads((tmp / "1.json").read_text()), json.loads((tmp / "2.json").read_text())
    for world, runs in ((1, one), (2, two)):
        for variant, run in runs.items():
            run["params"] = load_file(tmp / str(world) / f"{variant}.safetensors")
    return one, two


def assert_matches_plain(run: dict, plain: dict) -> None:
    reference = Reference(plain["losses"], plain["grad_norms"], plain["params"])
    problems = compare(run["losses"], run["grad_norms"], run["params"], reference)
    assert not problems, "; ".join(problems)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_single_process_matches_plain_torch(results, optimizer):
    one, _ = results
    assert_matches_plain(one[f"single{optimizer}"], one[f"plain{optimizer}"])


def test_plain_runs_differ_by_optimizer(results):
    """The three reference runs are different trainings (so matching each of them means something)."""
    one, _ = results
    finals = [one[f"plain{o}"]["params"]["lm_head.weight" if "lm_head.weight" in one["plain"]["params"]
                                        else next(iter(one["plain"]["params"]))] for o in OPTIMIZERS]
    assert (finals[0] - finals[1]).abs().max() > 1e-4 and (finals[1] - finals[2]).abs().max() > 1e-4
    assert one["plain+sgd+noclip"]["losses"][-1] < one["plain+sgd+noclip"]["losses"][0] - 0.1  # SGD learns


@pytest.mark.parametrize("variant", VARIANTS + [with_ac(v) for v in VARIANTS] + OPTIONS + UNCLIPPED)
def test_strategy_matches_plain_torch(results, variant):
    one, two = results
    assert_matches_plain(two[variant], one[f"plain{optimizer_of(variant)}"])


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
