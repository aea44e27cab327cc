"""The memory estimator, checked against measurement on real runs (world sizes 1 and 2, every strategy)."""

import importlib.util
import json

import pytest

from conftest import SCRIPTS
from disttrain.bench import memory as memory_bench
from disttrain.cli import main
from disttrain.config import load_config
from disttrain.memory import estimate
from disttrain.parallel.layout import zero1_partition


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """Every strategy at 1 and 2 ranks, and in the 2-rank launch the layouts tp2, tp2+sp, pp2 (1f1b, gpipe), cp2,
    and the embeddings and first block frozen (model.freeze) under ddp, fsdp and pp2."""
    out = tmp_path_factory.mktemp("memory")
    layouts = ",".join((*memory_bench.DEFAULT_LAYOUTS, *FROZEN))
    assert memory_bench.main(["--nproc", "2", "--n-layer", "2", "--d-model", "96", "--micro", "4",
                              "--layouts", layouts, "--out", str(out)]) == 0
    return json.loads((out / "memory.json").read_text())


@pytest.fixture(scope="module")
def measured_4_ranks(tmp_path_factory):
    """pp2 x dp2 (ddp: FSDP2 replicate on the data axis) and pp2 x fsdp2 under 1F1B, pp2 x dp2 under zbv, and
    tp2 x cp2, in one 4-rank launch."""
    out = tmp_path_factory.mktemp("memory4")
    assert memory_bench.main(["--nproc", "4", "--world-sizes", "4", "--n-layer", "4", "--d-model", "96", "--micro",
                              "4", "--strategies", "none", "--layouts", "pp2-1f1b,pp2-fsdp,pp2-zbv,tp2-cp2,pp2-cp2",
                              "--out", str(out)]) == 0
    return json.loads((out / "memory.json").read_text())["rows"]


FROZEN = ("frozen", "frozen-fsdp", "pp2-frozen")
KINDS = ("params", "grads", "optimizer", "activations")
TOLERANCE = 0.001
"""Relative error allowed (fp32 on CPU): the torch-native strategies measure 0.0%, DeepSpeed's offload 0.01%."""


def tolerance(strategy: str, kind: str) -> float:
    # DeepSpeed ZeRO-3's gradient partitions (flat buffers padded per rank, plus small parameters kept whole)
    # are estimated within 2.4% (measured: 2.36%, and 1.60% with offload), not exactly
    return 0.03 if strategy.startswith("deepspeed-z3") and kind == "grads" else TOLERANCE


def test_estimate_matches_measurement_for_every_strategy(measured):
    seen = set()
    for row in (r for r in measured["rows"] if not r.get("layout") and r["strategy"] not in FROZEN):
        seen.add((row["world"], row["strategy"], row["ac"]))
        for kind in KINDS:
            est, meas = row["estimated"][kind], row["measured"][kind]
            assert meas > 0 and abs(est - meas) <= tolerance(row["strategy"], kind) * meas, \
                (row["strategy"], row["world"], kind, est, meas)
    strategies = {"ddp", "zero1", "zero2", "fsdp", "hsdp"}
    assert {(w, s, ac) for w in (1, 2) for s in strategies for ac in (False, True)} <= seen
    assert (1, "single", False) in seen
    if importlib.util.find_spec("deepspeed"):  # ZeRO stages 0-3, and 1-3 with ZeRO-Offload
        zero = [f"deepspeed-z{n}" for n in range(4)] + [f"deepspeed-z{n}-off" for n in (1, 2, 3)]
        assert {(w, s, False) for w in (1, 2) for s in zero} <= seen


@pytest.fixture(scope="module")
def measured_16bit(tmp_path_factory):
    """bf16-mixed (every strategy, deepspeed's stages where installed) and bf16-true (no deepspeed)."""
    out = {}
    for precision, strategies in (("bf16-mixed", "single,ddp,zero1,zero2,fsdp,hsdp,deepspeed"),
                                  ("bf16-true", "single,ddp,zero1,fsdp")):
        path = tmp_path_factory.mktemp(precision)
        assert memory_bench.main(["--nproc", "2", "--n-layer", "2", "--d-model", "96", "--micro", "4", "--precision",
                                  precision, "--strategies", strategies, "--layouts", "", "--out", str(path)]) == 0
        out[precision] = json.loads((path / "memory.json").read_text())["rows"]
    return out


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_estimate_matches_measurement_in_16_bits(measured_16bit, measured, precision):
    """Autocast saves 16-bit weight copies (unless FSDP2 gathers in 16 bits, or DeepSpeed ZeRO-3's linear
    saves the parameter), bf16-true halves nearly everything: the estimate follows each case."""
    rows = measured_16bit[precision]
    assert {r["strategy"] for r in rows} >= {"single", "ddp", "zero1", "fsdp"}
    for row in rows:
        for kind in KINDS:
            est, meas = row["estimated"][kind], row["measured"][kind]
            # bf16-mixed's autocast caches are estimated within 1% (measured 0.97%), the rest exactly
            allowed = max(0.015 if precision == "bf16-mixed" else 0.0, tolerance(row["strategy"], kind))
            assert meas > 0 and abs(est - meas) <= allowed * meas, (row["strategy"], row["world"], kind, est, meas)
    fp32 = {(r["strategy"], r["world"], r["ac"]): r["measured"] for r in measured["rows"]}
    ddp = next(r["measured"] for r in rows if r["strategy"] == "ddp" and r["world"] == 2 and not r["ac"])
    # less, though autocast keeps a 16-bit copy of each weight and of ln1's output for each of q, k and v
    assert ddp["activations"] < 0.85 * fp32["ddp", 2, False]["activations"]
    assert (ddp["params"] < fp32["ddp", 2, False]["params"]) == (precision == "bf16-true")


def test_deepspeed_ranks_hold_what_their_partition_straddles(measured):
    """ZeRO-1/2 keep whole the gradients of the parameters their partition touches: the ranks differ, and the
    estimate follows each one (checked above); ZeRO-3 keeps small parameters whole on every rank."""
    pytest.importorskip("deepspeed")
    rows = {(r["strategy"], r["rank"]): r["measured"] for r in measured["rows"] if r["world"] == 2}
    ddp = rows["ddp", 0]
    assert rows["deepspeed-z2", 0]["grads"] != rows["deepspeed-z2", 1]["grads"]
    assert 0.5 * ddp["grads"] < rows["deepspeed-z2", 0]["grads"] < ddp["grads"]
    assert rows["deepspeed-z2", 0]["optimizer"] == pytest.approx(0.75 * ddp["optimizer"], rel=0.01)  # + master
    assert 0.5 * ddp["params"] < rows["deepspeed-z3", 0]["params"] < ddp["params"]


def test_sharding_shrinks_what_each_rank_holds(measured):
    assert measured["fsdp_over_ddp_model_state_bytes"] <= 0.52
    assert measured["zero1_over_ddp_optimizer_bytes"] <= 0.52
    ddp = next(r for r in measured["rows"] if r["strategy"] == "ddp" and r["world"] == 2 and not r["ac"])
    ac = next(r for r in measured["rows"] if r["strategy"] == "ddp" and r["world"] == 2 and r["ac"])
    assert ac["measured"]["activations"] < 0.3 * ddp["measured"]["activations"]


LAYOUT_TOLERANCE = 0.10
"""Relative error allowed for the model-parallel layouts (the issue's target; measured: 0.0% for each)."""


def _check_layout_rows(rows: list[dict], expected: dict[str, str]) -> dict:
    by = {}
    for row in rows:
        if row["strategy"] not in expected:
            continue
        assert row["layout"] == expected[row["strategy"]]
        for kind in KINDS:
            est, meas = row["estimated"][kind], row["measured"][kind]
            assert meas > 0 and abs(est - meas) <= LAYOUT_TOLERANCE * meas, \
                (row["strategy"], row["rank"], kind, est, meas)
        by[row["strategy"], row["rank"]] = row["measured"]
    ranks = {r["rank"] for r in rows}
    assert set(by) == {(label, rank) for label in expected for rank in ranks} and len(ranks) == rows[0]["world"]
    return by


def test_estimate_matches_measurement_under_tensor_and_pipeline_layouts(measured):
    """Per rank, over a step of 4 micro-batches: tensor shards (column / row / vocabulary splits by name), each
    pipeline stage's parameters (the tied embedding on both ends), and the activations each schedule keeps in
    flight, at their peak during the step."""
    rows = [r for r in measured["rows"] if r.get("layout")]
    by = _check_layout_rows(rows, {"tp2": "tp2", "tp2+sp": "tp2", "pp2-1f1b": "pp2", "pp2-gpipe": "pp2", "cp2": "cp2"})
    single = next(r["measured"] for r in measured["rows"] if r["strategy"] == "ddp" and r["world"] == 1
                  and not r["ac"])
    # the split is real: each tensor shard holds about half the model, sequence parallelism saves more
    assert by["tp2", 0]["params"] < 0.55 * single["params"]
    assert by["tp2+sp", 0]["activations"] < by["tp2", 0]["activations"] < 0.75 * single["activations"]
    # GPipe keeps all 4 micro-batches of its stage; 1F1B at most p - stage: 2 on the first, 1 on the last
    assert by["pp2-gpipe", 0]["activations"] > 1.9 * by["pp2-1f1b", 0]["activations"]
    assert by["pp2-gpipe", 1]["activations"] > 3.9 * by["pp2-1f1b", 1]["activations"]
    # context parallelism: each rank holds its half of the sequence, and the keys and values of all of it
    assert by["cp2", 0]["activations"] < 0.75 * single["activations"] and by["cp2", 0]["params"] == single["params"]


def test_frozen_parameters_are_held_without_gradients_or_optimizer_state(measured):
    """model.freeze: the frozen parameters are held (sharded under FSDP) but have no gradient and no optimizer state,
    exactly as estimated; a pipeline stage with nothing to train holds neither. The frozen embeddings and first
    block keep no activations, and the frozen (tied) head keeps no input: estimated exactly too."""
    rows = {(r["strategy"], r["rank"]): r for r in measured["rows"] if r["world"] == 2 and not r["ac"]}
    for label, whole in (("frozen", "ddp"), ("frozen-fsdp", "fsdp"), ("pp2-frozen", "pp2-1f1b")):
        for rank in (0, 1):
            row, est, unfrozen = rows[label, rank]["measured"], rows[label, rank]["estimated"], rows[whole, rank]
            for kind in KINDS:
                assert abs(est[kind] - row[kind]) <= TOLERANCE * max(row[kind], 1), (label, rank, kind, est, row)
            assert row["params"] == unfrozen["measured"]["params"]
            if label != "pp2-frozen" or rank == 0:  # (the last stage: block 1 and the head, both trained)
                assert row["grads"] < 0.9 * unfrozen["measured"]["grads"], (label, rank)
                assert row["optimizer"] < 0.9 * unfrozen["measured"]["optimizer"], (label, rank)
            assert row["activations"] < 0.6 * unfrozen["measured"]["activations"] or (label, rank) == ("pp2-frozen", 1)
    assert rows["pp2-frozen", 0]["measured"]["grads"] == rows["pp2-frozen", 0]["measured"]["optimizer"] == 0


def test_a_users_model_with_frozen_parameters_is_estimated_without_activations(monkeypatch):
    """A model the estimator has no activation formula for, which freezes 64 MiB itself: its model states still
    come out, the frozen bytes held without gradients or optimizer state; with model.freeze set as well the same
    (the freeze check runs only where activations are estimated), and the activations are unknown."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    table = 256 * 256 * 4
    for freeze in ("", "ballast"):
        cfg = load_config(None, ["model.name=tiny_models:bigram_with_ballast", f"model.freeze={freeze}"])
        est = estimate(cfg, 2, "ddp")
        assert est.params == 16 * 2**20 * 4 + table and est.optimizer == 2 * table + 4, freeze
        assert est.activations is None and not any("frozen parameters" in note for note in est.notes)


def test_estimate_matches_measurement_for_a_pipeline_with_a_data_axis(measured_4_ranks):
    by = _check_layout_rows(measured_4_ranks, {"pp2-1f1b": "pp2 x dp_replicate2", "pp2-fsdp": "pp2 x dp_shard2",
                                               "pp2-zbv": "pp2 x dp_replicate2", "tp2-cp2": "cp2 x tp2",
                                               "pp2-cp2": "pp2 x cp2"})
    for rank in range(4):  # FSDP2 on the data axis halves a stage's model states; activations are the same
        assert by["pp2-fsdp", rank]["params"] < 0.52 * by["pp2-1f1b", rank]["params"]
        assert by["pp2-fsdp", rank]["activations"] == by["pp2-1f1b", rank]["activations"]
        # a context split under a pipeline: the same stage's states, half of each sequence's activations and more
        assert by["pp2-cp2", rank]["params"] == by["pp2-1f1b", rank]["params"]
        assert 0.5 < by["pp2-cp2", rank]["activations"] / by["pp2-1f1b", rank]["activations"] < 0.75
    # the V's rank 0 holds the first and the last stage, and under a data axis the head's own copy of the tied
    # weight (one parameter without a data axis): counted exactly
    for row in measured_4_ranks:
        if row["strategy"] == "pp2-zbv":
            assert row["estimated"]["params"] == row["measured"]["params"], row["rank"]


def test_layout_estimate_picks_the_most_loaded_stage_and_models_the_schedules():
    base = ["model.n_layer=4", "data.micro_batch_size=2", "data.global_batch_size=16"]

    def est(*extra, world=2, rank=None):
        return estimate(load_config(None, [*base, *extra]), world, None, rank)

    gpipe, one = est("parallel.pipeline=2", "parallel.pipeline_schedule=gpipe"), est("parallel.pipeline=2")
    assert gpipe.layout == one.layout == "pp2" and one.activations < gpipe.activations
    # 1F1B's first stage keeps 2 micro-batches, its last 1: the most loaded is the first (the default vocabulary
    # is small); asking for a rank gives that rank's
    assert one.rank == 0 and est("parallel.pipeline=2", rank=1).activations < one.activations
    interleaved = est("parallel.pipeline=2", "parallel.pipeline_schedule=interleaved-1f1b")
    assert interleaved.activations < gpipe.activations
    # the V-shaped schedule holds 2p half-stage chunks on rank 0 (its first and last stage): 1F1B's peak
    assert est("parallel.pipeline=2", "parallel.pipeline_schedule=zbv").activations < gpipe.activations
    whole = est(world=1)
    tp = est("parallel.tensor=2")
    assert tp.layout == "tp2" and whole.params / 2 < tp.params < 0.6 * whole.params
    assert est("parallel.tensor=2", "parallel.sequence_parallel=true").activations < tp.activations
    mixed = est("parallel.pipeline=2", "parallel.tensor=2", "parallel.strategy=fsdp", world=8)
    assert mixed.layout == "pp2 x dp_shard2 x tp2" and mixed.params < tp.params / 3


def test_estimate_memory_prints_the_layout(capsys):
    assert main(["estimate-memory", "--world-size", "4", "--set", "parallel.pipeline=2", "--set",
                 "model.n_layer=4"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.split() and line.split()[0] in
            ("ddp", "fsdp", "zero2", "hsdp")}
    assert rows["ddp"].endswith("pp2 x dp_replicate2") and rows["fsdp"].endswith("pp2 x dp_shard2")
    assert "zero1" not in out.split("(MiB)")[1].split("note:")[0]  # does not compose with a pipeline
    assert "pipeline (1f1b" in out


def test_zero1_partition_balances_like_zero_redundancy_optimizer():
    import torch

    shapes = [torch.Size(s) for s in [(10, 10), (50, 2), (3,), (7, 7), (5,)]]
    parts = zero1_partition(shapes, 2)
    assert sorted(i for part in parts for i in part) == list(range(5))
    assert parts[0][0] == 0 and parts[1][0] == 1  # largest first, each to the least-loaded rank


def test_estimate_memory_command_compares_strategies_against_a_budget(capsys):
    assert main(["estimate-memory", "--world-size", "2", "--budget-gib", "0.2", "--set", "model.n_layer=12",
                 "--set", "model.d_model=256"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.split() and line.split()[0] in
            ("ddp", "zero1", "zero2", "fsdp", "hsdp")}
    assert len(rows) == 5 and rows["fsdp"].endswith("yes") and rows["ddp"].endswith("with AC")
    if importlib.util.find_spec("deepspeed"):  # the optional strategy has its row (ZeRO stage 2 by default)
        ds = next(line.split() for line in out.splitlines() if line.startswith("deepspeed "))
        assert float(ds[6]) < float(rows["ddp"].split()[6]) and ds[-1] in ("yes", "AC", "no")
    cfg = load_config(None, ["model.n_layer=12", "model.d_model=256"])
    fsdp, ddp = estimate(cfg, 2, "fsdp").params, estimate(cfg, 2, "ddp").params
    assert ddp / 2 <= fsdp <= ddp / 2 * 1.01  # half each, padding only rounds up (a row per 2-row shard at most)


def test_deepspeed_estimate_follows_the_zero_stage():
    def per_rank(stage, *model):
        cfg = load_config(None, ["parallel.strategy=deepspeed", f"parallel.deepspeed_stage={stage}", *model])
        return estimate(cfg, 4, "deepspeed"), estimate(cfg, 4, "ddp")

    big = ("model.d_model=512", "model.n_layer=4")  # its matrices are above ZeRO-3's persistence threshold
    stage0, ddp = per_rank(0, *big)
    assert (stage0.params, stage0.grads, stage0.optimizer) == (ddp.params, ddp.grads, ddp.optimizer)
    stage2, stage3 = per_rank(2, *big)[0], per_rank(3, *big)[0]
    assert stage2.params == ddp.params and ddp.grads / 4 <= stage2.grads < ddp.grads / 2  # a quarter + boundaries
    assert stage3.params < stage2.params and stage3.total(False) < stage2.total(False) < stage0.total(False)
    # the default model's tensors are all small: ZeRO-3 keeps them whole next to their partitions, and says so
    small = per_rank(3)[0]
    assert small.params == pytest.approx(1.25 * per_rank(3)[1].params, rel=0.01)
    assert any("stay whole on every rank" in note for note in small.notes)


def test_deepspeed_gradient_bucket_is_capped_by_the_model_size(tmp_path):
    """DeepSpeed's default bucket is 5e8 elements (2 GB of float32, held all run long under ZeRO-3): disttrain
    caps it at a rank's share of the model there, and a bucket the user's JSON sets is kept, and estimated."""
    cfg = load_config(None, ["parallel.strategy=deepspeed", "parallel.deepspeed_stage=3"])
    capped = estimate(cfg, 2, "deepspeed")
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"zero_optimization": {"reduce_bucket_size": 500_000_000}}))
    cfg = load_config(None, ["parallel.strategy=deepspeed", "parallel.deepspeed_stage=3",
                             f"parallel.deepspeed_config={user}"])
    assert estimate(cfg, 2, "deepspeed").grads - capped.grads > 1.9e9


@pytest.fixture(scope="module")
def measured_schedules(tmp_path_factory):
    """pp2 under the schedules with two stages per rank (interleaved-1f1b, zero-bubble, zbv, dualpipev): 4 blocks,
    one per stage, in one 2-rank launch."""
    out = tmp_path_factory.mktemp("memory_schedules")
    assert memory_bench.main(["--nproc", "2", "--world-sizes", "2", "--n-layer", "4", "--d-model", "64", "--micro",
                              "4", "--strategies", "none", "--layouts",
                              "pp2-interleaved,pp2-zero-bubble,pp2-zbv,pp2-dualpipev", "--out", str(out)]) == 0
    return json.loads((out / "memory.json").read_text())["rows"]


def test_estimate_matches_measurement_under_every_two_stage_schedule(measured_schedules):
    """The activations each rank holds at its peak follow torch's own order of forwards and (input, weight)
    backwards; the split backward holds a micro-batch until its weight part."""
    by = _check_layout_rows(measured_schedules, {label: "pp2" for label in
                                                 ("pp2-interleaved", "pp2-zero-bubble", "pp2-zbv", "pp2-dualpipev")})
    # the V puts the first and the last stage on rank 0: the same parameters as interleaved's rank 0 minus a block
    assert by["pp2-zbv", 0]["params"] == by["pp2-dualpipev", 0]["params"] != by["pp2-interleaved", 0]["params"]


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zero-bubble", "zbv", "dualpipev"])
def test_torch_gives_the_order_of_every_multi_stage_schedule(schedule):
    """The estimate reads torch's own per-rank order (a private method): a torch that moves it falls back to an
    approximation with a note, and this test says so."""
    from disttrain.parallel.placement import in_flight, torch_order

    odd = 7 if schedule in ("zbv", "dualpipev") else 6  # the looped ones need a multiple of the ranks
    looped = schedule in ("interleaved-1f1b", "zero-bubble")  # (and take more stages a rank)
    for ranks, microbatches, v in ((2, 1, 2), (2, 4, 2), (2, odd, 2), (4, 8, 2), *(((2, 4, 3), (4, 8, 4)) * looped)):
        for rank in range(ranks):
            order = torch_order(schedule, ranks, rank, microbatches, v)
            assert order is not None
            forwards = [stage for stage, kind in order if kind == "F"]
            assert len(forwards) == v * microbatches  # every micro-batch through each of its stages
            assert [kind for _, kind in order].count("F") == sum(kind in "BW" for _, kind in order)
            chunks, exact = in_flight(schedule, ranks, rank, microbatches, (1.0,) * v)
            assert exact and 0 < len(chunks) <= v * microbatches and max(chunks) < v


def test_without_torch_s_order_interleaving_counts_its_warm_up(monkeypatch):
    """A torch that computes its order elsewhere: interleaved-1f1b's count of micro-batches in flight from its
    warm-up ((v - 1) rounds and 2 (p - 1 - r) forwards, then one), equal to the played order's at 2-4 stages a rank."""
    from disttrain.parallel import placement

    exact = {(v, p, m, r): placement.in_flight("interleaved-1f1b", p, r, m, (1.0,) * v)[0]
             for v in (2, 3, 4) for p, m in ((2, 4), (4, 8), (2, 8)) for r in range(p)}
    monkeypatch.setattr(placement, "torch_order", lambda *args: None)
    for (v, p, m, r), chunks in exact.items():
        approx, played = placement.in_flight("interleaved-1f1b", p, r, m, (1.0,) * v)
        assert not played and len(approx) == len(chunks), (v, p, m, r)


def test_ddp_holds_accumulated_gradients_beside_its_buckets_and_the_estimate_counts_them():
    """Measured on one rank (a gloo group in this process): the micro-batches before the last accumulate into new
    gradient tensors (the step cleared them to None) while DDP's buckets already exist, so a step that accumulates
    holds the gradients twice; one micro-batch per step, or a strategy without buckets, holds them once."""
    import torch

    from disttrain.backend import create_backend
    from disttrain.bench.gpu.kit import runtime as one_rank_runtime
    from disttrain.memory import measure
    from disttrain.models.gpt import GPT
    from disttrain.optim import optimizer_factory

    runtime = one_rank_runtime(torch.device("cpu"), group=True)
    x = torch.randint(0, 256, (2, 16))
    grads = {}
    for strategy, micro_batches in (("ddp", 2), ("ddp", 1), ("zero1", 2), ("single", 2)):
        cfg = load_config(None, [f"parallel.strategy={strategy}", "model.n_layer=1", "model.d_model=32",
                                 "model.seq_len=16", "data.micro_batch_size=2",
                                 f"data.global_batch_size={2 * micro_batches}"])
        got = measure(lambda cfg=cfg: create_backend(GPT(cfg.model), optimizer_factory(cfg.optim), cfg.parallel,
                                                     runtime=runtime), [{"input_ids": x, "labels": x}] * micro_batches)
        grads[strategy, micro_batches] = got["grads"]
        assert got["grads"] == estimate(cfg, 1, strategy).grads, (strategy, micro_batches)
    assert grads["ddp", 2] == grads["zero1", 2] == 2 * grads["ddp", 1] == 2 * grads["single", 2]
