"""The `deepspeed` strategy (optional extra) on 2 real ranks (gloo, DS_ACCELERATOR=cpu) against the
single-process reference: ZeRO stages 0-3, ZeRO-Offload, and checkpoints that resume across strategies.
One launch trains every variant (DeepSpeed's start-up is shared), and `deepspeed-config` writes its JSON."""

import json
import sys

import pytest

from conftest import SCRIPTS
from disttrain.cli import main
from disttrain.config import ConfigError, load_config
from disttrain.parallel.deepspeed.config import DeepSpeedConfig

sys.path.insert(0, str(SCRIPTS))

STAGES = ["deepspeed+stage0", "deepspeed+stage1", "deepspeed+stage2", "deepspeed+stage3",
          "deepspeed+stage2+offload", "deepspeed+stage3+offload"]
UNCLIPPED = ["deepspeed+stage0+sgd+noclip", "deepspeed+stage2+sgd+noclip", "deepspeed+stage3+sgd+noclip"]
RESUMES = ["deepspeed+stage2>ddp", "ddp>deepspeed+stage3"]  # trained to step 6 under A, resumed under B
# the biases and norms frozen: the factory's group of them is empty, and DeepSpeed drops it (optim.align_groups);
# with the embeddings and first block frozen too, into a pipeline whose first stage has nothing to train
EMPTY_GROUP = ["deepspeed+stage2+freezevec>ddp+freezevec", "fsdp+freezevec>deepspeed+stage3+freezevec",
               "deepspeed+stage0+freezevec>zero1+freezevec", "deepspeed+stage2+freezeboth>ddp+pp2+freezeboth"]
BF16 = "deepspeed+stage2+bf16"  # autocast around the engine, fp32 weights: within bf16-mixed's tolerance
# fp16-mixed: autocast, fp32 weights, disttrain's dynamic loss scale driving the engine's: the same numbers as
# ddp under fp16-mixed (torch's GradScaler), skipped steps included
FP16 = ["ddp+fp16", "deepspeed+stage0+fp16", "deepspeed+stage1+fp16", "deepspeed+stage2+fp16",
        "deepspeed+stage3+fp16", "deepspeed+stage2+offload+fp16"]


COMPILED = ["deepspeed+stage2+compile"]  # the blocks compiled inside the engine (parallel.compile; ZeRO-3 is refused)
# (first: a ZeRO-3 engine replaces torch.nn.functional.linear for the rest of the process, which a later compile
# would trace instead of torch's)

ONE_PROCESS = ["single", "plain", "plain+sgd+noclip", "single+freezevec", "single+freezeboth"]
LAUNCHED = [*COMPILED, *STAGES, *UNCLIPPED, *RESUMES, *EMPTY_GROUP, BF16, *FP16]
"""Trained by conftest's `gpt_parity`, in the same two processes as test_parallel_fsdp.py's variants."""


@pytest.fixture(scope="module")
def results(gpt_parity):
    pytest.importorskip("deepspeed")
    one, two = gpt_parity
    two = {**two, "plain": one["plain"], "plain+sgd+noclip": one["plain+sgd+noclip"]}
    return one["single"], {**two, **{v: one[v] for v in ("single+freezevec", "single+freezeboth")}}


@pytest.mark.parametrize("variant", STAGES + UNCLIPPED)
def test_zero_stage_matches_plain_torch(results, variant):
    """Loss, grad norm and final parameters against the plain-torch loop (tests/scripts/plain_reference.py)."""
    from plain_reference import Reference, compare

    _, two = results
    plain = two["plain+sgd+noclip" if "+sgd+noclip" in variant else "plain"]
    problems = compare(two[variant]["losses"], two[variant]["grad_norms"], two[variant]["params"],
                       Reference(plain["losses"], plain["grad_norms"], plain["params"]))
    assert not problems, "; ".join(problems)


@pytest.mark.parametrize("variant", STAGES + COMPILED)
def test_zero_stage_matches_single_process(results, variant):
    reference, two = results
    assert len(two[variant]["losses"]) == 12
    assert (two[variant]["graphs"] > 0) == (variant in COMPILED)
    assert two[variant]["losses"] == pytest.approx(reference["losses"], abs=1e-5)
    for step in reference["eval"]:
        assert two[variant]["eval"][step] == pytest.approx(reference["eval"][step], abs=1e-5)


def test_bf16_mixed_trains_within_tolerance_of_fp32(results):
    reference, two = results
    assert two[BF16]["losses"][-1] < two[BF16]["losses"][0] - 1.0
    assert two[BF16]["losses"] == pytest.approx(reference["losses"], abs=0.05)
    assert max(abs(a - b) for a, b in zip(two[BF16]["losses"], reference["losses"], strict=True)) > 1e-4  # bf16 ran
    assert two[BF16]["eval"]["12"] == pytest.approx(reference["eval"]["12"], abs=0.02)  # as test_precision


@pytest.mark.parametrize("variant", FP16[1:])
def test_fp16_mixed_matches_ddp_under_fp16_mixed(results, variant):
    _, two = results
    ddp = two[FP16[0]]
    assert ddp["losses"][1] > ddp["losses"][0] - 0.01  # the first steps overflow at scale 65536 and are skipped
    assert ddp["losses"][-1] < ddp["losses"][0] - 0.3  # it learns, after the skipped steps
    assert two[variant]["losses"] == pytest.approx(ddp["losses"], abs=1e-3)
    assert two[variant]["eval"]["12"] == pytest.approx(ddp["eval"]["12"], abs=1e-3)


@pytest.mark.parametrize("variant", RESUMES + EMPTY_GROUP)
def test_checkpoint_resumes_across_strategies(results, variant):
    reference, two = results
    for frozen in ("freezevec", "freezeboth"):
        reference = two[f"single+{frozen}"] if frozen in variant else reference
    assert two[variant]["losses"] == pytest.approx(reference["losses"][6:], abs=1e-5)
    assert two[variant]["eval"]["12"] == pytest.approx(reference["eval"]["12"], abs=1e-5)


def test_the_engines_collectives_are_timed_and_counted(results):
    """comm_s / comm_bytes under DeepSpeed (parallel/deepspeed/timed.py): what each stage sends per step, from its
    design, with 2 micro-batches per rank per step (global batch 16, micro-batch 4, 2 ranks)."""
    _, two = results
    numel = sum(t.numel() for t in two["ddp"]["params"].values()) - two["ddp"]["params"]["tok_emb.weight"].numel()
    grads = 4 * numel  # fp32 gradients (tied weights: once), the size of every parameter gathered in fp32 too
    expected = {"deepspeed+stage0": grads,  # all-reduced once, at the accumulation boundary, as DDP does
                "deepspeed+stage1": 2 * grads,  # reduced at the boundary, the updated partitions all-gathered
                "deepspeed+stage2": 3 * grads}  # reduced after each micro-batch (partitioned gradients), gathered
    for variant, nbytes in expected.items():
        for m in two[variant]["metrics"]:
            assert 0 <= m["comm_exposed_s"] <= m["comm_s"] < m["step_time_s"], (variant, m)
            assert m["comm_s"] > 0 and m["comm_bytes"] == pytest.approx(nbytes, abs=64), (variant, m)  # + flags, norm
    # ZeRO-3: at least the gradients reduced and the parameters gathered once; at most gathered for each micro-batch's
    # forward and backward and reduced after each (it keeps gathered what its prefetcher will soon use again), from
    # the second step on (the first gathers more while ZeRO-3 traces the order in which modules run)
    third = two["deepspeed+stage3"]["metrics"]
    assert all(m["comm_s"] > 0 for m in third) and third[0]["comm_bytes"] >= third[1]["comm_bytes"]
    assert all(2 * grads < m["comm_bytes"] <= 6 * grads for m in third[1:]), [m["comm_bytes"] / grads for m in third]


def deepspeed_config(args: list[str], tmp_path, monkeypatch, capsys) -> tuple[int, str]:
    """`disttrain deepspeed-config ARGS` in this process (it starts nothing): (exit code, stderr)."""
    monkeypatch.chdir(tmp_path)
    code = main(["deepspeed-config", *args])
    return code, capsys.readouterr().err


def test_deepspeed_config_writes_the_engine_json(tmp_path, monkeypatch, capsys):
    user = tmp_path / "user.json"
    user.write_text(json.dumps({"zero_optimization": {"overlap_comm": False, "reduce_bucket_size": 1000},
                                "train_batch_size": 32}))
    out = tmp_path / "ds.json"
    code, err = deepspeed_config(["--nproc", "2", "--set", "parallel.deepspeed_stage=3", "--set",
                                  "parallel.cpu_offload=true", "--set", "optim.grad_clip=0.5", "--set",
                                  f"parallel.deepspeed_config={user}", "-o", str(out)], tmp_path, monkeypatch, capsys)
    assert code == 0, err
    ds = json.loads(out.read_text())
    assert ds["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                       "offload_param": {"device": "cpu"}, "overlap_comm": False,
                                       "reduce_bucket_size": 1000}
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"],
            ds["gradient_clipping"]) == (32, 8, 2, 0.5)


def test_generated_json_caps_the_gradient_bucket_by_the_model_size(tmp_path, monkeypatch, capsys):
    """ZeRO-1/2: one bucket of the model's size (DeepSpeed's default is 5e8 elements); ZeRO-3, which holds it
    all run: a rank's share."""
    from disttrain.models import build_model

    numel = sum(p.numel() for p in build_model(load_config(None, []).model).parameters())
    for stage, bucket in ((2, numel), (3, (numel + 1) // 2)):
        out = tmp_path / f"ds{stage}.json"
        code, err = deepspeed_config(["--nproc", "2", "--set", f"parallel.deepspeed_stage={stage}", "-o", str(out)],
                                     tmp_path, monkeypatch, capsys)
        assert code == 0, err
        assert json.loads(out.read_text())["zero_optimization"]["reduce_bucket_size"] == bucket < 500_000_000


@pytest.mark.parametrize("args, message", [
    (["--set", "parallel.deepspeed_stage=4"], "parallel.deepspeed_stage = 4: must be 0, 1, 2 or 3"),
    (["--nproc", "3"], "data.global_batch_size = 32 is not a positive multiple"),
    (["--set", "parallel.deepspeed_config=missing.json"], "file not found"),
])
def test_deepspeed_config_bad_values_exit_2_in_one_line(tmp_path, monkeypatch, capsys, args, message):
    code, err = deepspeed_config([*args, "-o", str(tmp_path / "ds.json")], tmp_path, monkeypatch, capsys)
    assert code == 2
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "ds.json").exists()


@pytest.mark.parametrize("user, message", [
    ({"gradient_clipping": 0.5}, "'gradient_clipping' = 0.5 disagrees with optim.grad_clip"),
    ({"zero_optimization": {"stage": 3}}, "'zero_optimization.stage' = 3 disagrees with parallel.deepspeed_stage"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, "disagrees with parallel.cpu_offload"),
    ({"train_micro_batch_size_per_gpu": 4}, "disagrees with data.micro_batch_size"),
    ({"optimizer": {"type": "Adam"}}, "has a 'optimizer' section; disttrain sets that through optim"),
    ({"bf16": {"enabled": True}}, "'bf16' = .* disagrees with parallel.precision = 'fp32'"),
    ({"torch_autocast": {"enabled": True}}, "sets precision through parallel.precision"),  # would scale twice
    ({"zero_optimization": {"offload_param": {"device": "cpu"}}}, "offload_param.device' = \"cpu\" disagrees"),
    ({"zero_optimization": {"compute_grad_norm": False}}, "'zero_optimization.compute_grad_norm' = false"),
])
def test_user_json_that_disagrees_is_refused(tmp_path, user, message):
    path = tmp_path / "user.json"
    path.write_text(json.dumps(user))
    with pytest.raises(ConfigError, match=message):
        DeepSpeedConfig.from_config(load_config(None, [f"parallel.deepspeed_config={path}"]), 2)


SEED_004_JSON = {  # ../shared/seeds/004: ZeRO-3, both offloads to pinned host memory, bf16
    "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2,
    "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                          "offload_optimizer": {"device": "cpu", "pin_memory": True}},
    "bf16": {"enabled": True}}


def test_the_design_documents_json_is_accepted_where_it_agrees(tmp_path):
    """The seed's JSON states what stage 3 + cpu_offload + bf16-mixed are: accepted, its pin_memory kept, and
    the bf16 section left to disttrain's autocast. The same JSON under settings that say otherwise: refused."""
    path = tmp_path / "seed.json"
    path.write_text(json.dumps(SEED_004_JSON))
    agreeing = ["parallel.deepspeed_stage=3", "parallel.cpu_offload=true", "parallel.precision=bf16-mixed"]
    ds = DeepSpeedConfig.from_config(load_config(None, [f"parallel.deepspeed_config={path}", *agreeing]), 2).to_dict()
    assert ds["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert ds["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert "bf16" not in ds and ds["train_batch_size"] == 32
    for other, message in [("parallel.precision=fp16-mixed", "'bf16' = .* disagrees with parallel.precision"),
                           ("parallel.cpu_offload=false", "offload_optimizer.device' = \"cpu\" disagrees"),
                           ("parallel.deepspeed_stage=2", "'zero_optimization.stage' = 3 disagrees")]:
        settings = [s for s in agreeing if s.split("=")[0] != other.split("=")[0]] + [other]
        with pytest.raises(ConfigError, match=message):
            DeepSpeedConfig.from_config(load_config(None, [f"parallel.deepspeed_config={path}", *settings]), 2)
    path.write_text(json.dumps({**SEED_004_JSON, "bf16": {"enabled": True, "immediate_grad_update": True}}))
    with pytest.raises(ConfigError, match="'bf16' = .* disagrees"):
        DeepSpeedConfig.from_config(load_config(None, [f"parallel.deepspeed_config={path}", *agreeing]), 2)
