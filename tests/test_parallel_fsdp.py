"""Every strategy on 2 real ranks (gloo) against the single-process run and against an independent
plain-torch loop (tests/scripts/plain_reference.py): per-step loss, grad norm and the final parameters,
under AdamW with clipping, AdamW without clipping and SGD without clipping (where a wrong gradient scale
cannot hide behind the clip or Adam's scale invariance). One launch trains all variants in one process
group (start-up is shared)."""

import sys

import pytest
import torch

from conftest import SCRIPTS

sys.path.insert(0, str(SCRIPTS))
from plain_reference import Reference, compare  # noqa: E402

VARIANTS = ["ddp", "zero1", "zero2", "fsdp", "zero3", "hsdp:1", "hsdp:2"]  # hsdp:N = shard groups of N ranks
# options, each once (FSDP2 CPUOffloadPolicy runs on CPU without pinned memory; explicit prefetch of N blocks)
OPTIONS = ["fsdp+offload", "zero2+offload", "hsdp+offload:1", "fsdp+prefetch2", "zero2+prefetch1"]
# optimizers against the plain loop: "" = AdamW with grad_clip 1.0 (the job's default)
OPTIMIZERS = ["", "+noclip", "+sgd+noclip"]
# gradient compression (parallel.grad_compression): close to the exact run, not equal to it
COMPRESSED = ["ddp+gcfp16", "ddp+gcbf16", "ddp+powersgd+tinybuckets", "fsdp+gcbf16", "zero2+gcfp16"]
UNCLIPPED = ["ddp+sgd+noclip", "zero1+sgd+noclip", "zero2+sgd+noclip", "fsdp+sgd+noclip", "hsdp+sgd+noclip:1",
             "ddp+noclip", "fsdp+noclip", "hsdp+noclip:1"]


def optimizer_of(variant: str) -> str:
    return "".join(f"+{flag}" for flag in ("sgd", "noclip") if f"+{flag}" in variant)


def with_ac(variant: str) -> str:
    """`hsdp:1` -> `hsdp+ac:1`: the same variant with activation checkpointing."""
    strategy, colon, shard = variant.partition(":")
    return f"{strategy}+ac{colon}{shard}"


ONE_PROCESS = ["single", "single+ac", *(f"single{o}" for o in OPTIMIZERS[1:]), *(f"plain{o}" for o in OPTIMIZERS)]
# communication metered as on CUDA (nccl's device timing; here gloo, which has none): the same numbers
DEVICE_TIMED = ["ddp+devtimed", "ddp+gcbf16+devtimed", "fsdp+devtimed"]
LAUNCHED = VARIANTS + [with_ac(v) for v in VARIANTS] + OPTIONS + UNCLIPPED + COMPRESSED + DEVICE_TIMED
"""Trained by conftest's `gpt_parity`, in the same two processes as test_parallel_deepspeed.py's variants."""


@pytest.fixture(scope="module")
def results(gpt_parity):
    return gpt_parity


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
    # the embedding (tied to the head) learns under every optimizer (a key bias, for one, gets no gradient)
    finals = [one[f"plain{o}"]["params"]["tok_emb.weight"] for o in OPTIMIZERS]
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
    assert len(got["losses"]) == 12
    assert got["losses"] == pytest.approx(reference["losses"], abs=1e-5)
    assert got["eval"].keys() == reference["eval"].keys() == {"6", "12"}
    for step in reference["eval"]:  # 33 eval samples: uneven shards, sharded forward on every rank
        assert got["eval"][step] == pytest.approx(reference["eval"][step], abs=1e-5)


@pytest.mark.parametrize("variant", OPTIONS)
def test_offload_and_prefetch_match_single_process(results, variant):
    one, two = results
    assert two[variant]["losses"] == pytest.approx(one["single"]["losses"], abs=1e-5)
    for step in one["single"]["eval"]:
        assert two[variant]["eval"][step] == pytest.approx(one["single"]["eval"][step], abs=1e-5)


@pytest.mark.parametrize("variant", COMPRESSED)
def test_compressed_gradients_train_close_to_exact(results, variant):
    one, two = results
    got, exact = two[variant]["losses"], one["single"]["losses"]
    assert max(abs(a - b) for a, b in zip(got, exact, strict=True)) > 1e-6  # the compression is really on
    tolerance = 0.2 if "powersgd" in variant else 0.02  # rank-1 PowerSGD of a 20-step run vs a half-precision wire
    assert got == pytest.approx(exact, abs=tolerance)
    assert got[-1] < got[0] - 1.0  # it learns (PowerSGD with many buckets on gloo would hang: it got one)


@pytest.mark.parametrize("variant", DEVICE_TIMED)
def test_device_timed_communication_changes_no_number(results, variant):
    """On CUDA, DDP's all-reduce goes through comm.device_timed_hook and FSDP's collectives run asynchronously
    (their Work kept for nccl's timing): the same training, bit for bit, and the same bytes counted."""
    _, two = results
    run, host_timed = two[variant], two[variant.replace("+devtimed", "")]
    assert run["losses"] == host_timed["losses"] and run["grad_norms"] == host_timed["grad_norms"]
    for name, tensor in host_timed["params"].items():
        assert torch.equal(run["params"][name], tensor), name
    assert [m["comm_bytes"] for m in run["metrics"]] == [m["comm_bytes"] for m in host_timed["metrics"]]
    assert {m["comm_s"] for m in run["metrics"]} == {None}  # gloo times nothing on a device: not reported


def test_in_run_cost_figures_are_recorded_per_step(results):
    _, two = results
    numel = sum(t.numel() for t in two["ddp"]["params"].values()) - two["ddp"]["params"]["tok_emb.weight"].numel()
    for variant in ("ddp", "fsdp", "zero2"):
        for m in two[variant]["metrics"]:
            assert 0 <= m["comm_exposed_s"] <= m["comm_s"] < m["step_time_s"] <= m["step_time_max_s"]
            assert m["comm_exposed_s"] <= m["comm_exposed_s_max"]
            assert m["comm_s"] > 0, (variant, m)
            assert m["slowest_rank"] in (0, 1) and m["mfu"] is None and m["tflops"] > 0
            assert 0 < m["mem_peak_gib"] <= m["mem_peak_gib_max"] < 8
    ddp = two["ddp"]["metrics"]
    assert {m["comm_bytes"] for m in ddp} == {4 * numel}  # every fp32 gradient all-reduced once (tied: once)
    # gradients cross the wire in half precision; PowerSGD sends low-rank factors after its first two steps
    assert {m["comm_bytes"] for m in two["ddp+gcfp16"]["metrics"]} == {2 * numel}
    assert max(m["comm_bytes"] for m in two["ddp+powersgd+tinybuckets"]["metrics"][2:]) < 0.2 * 4 * numel
    # FSDP: all-gathers in forward and backward (fp32 parameters) plus the reduce-scatter (bf16 with compression)
    fsdp, fsdp_bf16 = two["fsdp"]["metrics"][0]["comm_bytes"], two["fsdp+gcbf16"]["metrics"][0]["comm_bytes"]
    blocks = sum(t.numel() for name, t in two["fsdp"]["params"].items() if name.startswith("blocks."))
    micro = 16 // (4 * 2)  # global batch / (micro-batch x ranks) of the job (tests/scripts/strategy_parity.py)
    # per micro-batch the root is gathered once and each block twice; gradients are reduce-scattered once per step
    assert fsdp == 4 * micro * (2 * blocks + (numel - blocks)) + 4 * numel
    assert fsdp - fsdp_bf16 == pytest.approx(2 * numel, rel=0.01)  # half of the 4-byte reduce-scatter
    # HSDP with shards of one rank: no all-gather, no reduce-scatter; FSDP2 all-reduces every gradient over the
    # replicate group itself, which its hook counts. No reduce-scatter ended before it to time it from: comm_s is
    # None, not a part of the step's communication passed off as all of it
    hsdp = two["hsdp:1"]["metrics"]
    assert {m["comm_bytes"] for m in hsdp} == {4 * numel} and {m["comm_s"] for m in hsdp} == {None}


def test_hsdp_whose_shard_groups_span_nodes_says_which_size_shards_within_one(caplog):
    """2 nodes x 4 ranks: the default shard size (every rank) makes HSDP plain FSDP over the nodes' links."""
    from types import SimpleNamespace

    from disttrain.config import ParallelConfig
    from disttrain.parallel.fsdp import _warn_across_nodes

    runtime = SimpleNamespace(rank=0, world_size=8, launch=SimpleNamespace(local_world_size=4))
    _warn_across_nodes(runtime, 8, 8, ParallelConfig(strategy="hsdp"))
    assert "each shard group spans 8 ranks, more than the 4 of a node" in caplog.text
    assert "set parallel.hsdp_shard_size = 4" in caplog.text
    caplog.clear()
    _warn_across_nodes(runtime, 2, 4, ParallelConfig(strategy="hsdp", hsdp_shard_size=2))  # x tp 2: within a node
    _warn_across_nodes(SimpleNamespace(rank=0, world_size=4, launch=runtime.launch), 4, 4, ParallelConfig())
    assert caplog.text == ""
