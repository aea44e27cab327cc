"""Models split across ranks (parallel/mesh.py, compose.py, tensor.py): every layout gives the single-process
losses, gradient norms, evaluation and final parameters of the same job (fp32, 12 steps, within 1e-5), and a
checkpoint saved under one layout resumes under another. One launch per world size trains all the variants
(start-up is shared); the layouts are checked as arithmetic, in one line, before anything starts."""

import glob
import itertools
import json
import random
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import SCRIPTS, cli_env, read_metrics, run_alongside, run_cli
from disttrain.config import ConfigError, load_config, validate
from disttrain.parallel.mesh import MeshLayout, layout_for

COMPILED = ["ddp+compile", "fsdp+compile+ac", "ddp+pp2+zb+layers4+compile", "ddp+cp2+compile"]
# 2 ranks: tensor parallel over both (data degree 1: no data axis); a pipeline of 2 stages under each schedule
# (interleaved, zero-bubble, zbv and dualpipev put 2 virtual stages on each rank: a 4-block model, `layers4`; the V of
# zbv and dualpipev puts the first and last stage, and so the tied embedding and head, on rank 0; interleaved and
# zero-bubble with 3 stages a rank, parallel.pipeline_stages_per_rank, on a 6-block model)
# (+lp: the loss on logits split by vocabulary, loss parallel; +ac: activation checkpointing composes)
TWO = ["ddp+tp2", "ddp+tp2+sp", "ddp+tp2+lp", "fsdp+tp2", "ddp+pp2+gpipe", "ddp+pp2+1f1b",
       "ddp+pp2+i1f1b+layers4", "ddp+pp2+zb+layers4", "ddp+pp2+zbv+layers4", "ddp+pp2+i1f1b+v3+layers6",
       "ddp+pp2+zb+v3+layers6",
       "ddp+pp2+dualpipev+layers4", "ddp+tp2+ac", "ddp+pp2+ac",
       # context parallelism: each sequence cut in 2 chunks, attention over the gathered keys and values
       "ddp+cp2", "fsdp+cp2+ac",
       # frozen parameters (model.freeze): the first pipeline stage has nothing to train (an empty optimizer, no
       # gradient to clip) under 1F1B and zero-bubble; FSDP2 and ZeRO shard groups of trainable and frozen ones
       # (sequence parallel: torch's SequenceParallel re-registers the norms' parameters, which stay frozen)
       "ddp+pp2+freeze", "ddp+pp2+zb+layers4+freeze", "fsdp+tp2+freeze", "ddp+tp2+sp+freeze", "fsdp+freeze",
       "zero2+freeze",
       # compiled blocks (parallel.compile, aot_eager: traced, the same arithmetic) under data parallelism, FSDP2 with
       # activation checkpointing, a pipeline whose schedule splits the backward, and a context split's gathers
       *COMPILED]
# bf16-mixed: against one process in bf16-mixed, to bf16's rounding
MIXED = ["ddp+tp2+bf16+lp", "ddp+pp2+bf16", "ddp+cp2+bf16"]
# 4 ranks: tp2 x fsdp2, tp2 (sequence parallel) x replicate2, hsdp 2 x 2, pp2 x replicate2, pp2 x fsdp2, pp2 x tp2
# (and with sequence parallelism: each stage sends its share of the sequence), pp2 x fsdp2 under zero-bubble,
# pp2 x replicate2 under zbv and pp2 x fsdp2 under dualpipev, fsdp2 x cp2, and tp2 x cp2 (sequence parallel; loss
# parallel)
FOUR = ["fsdp+tp2+lp", "ddp+tp2+sp", "hsdp:2", "ddp+pp2", "fsdp+pp2", "ddp+pp2+tp2", "ddp+pp2+tp2+sp",
        "fsdp+pp2+zb+layers4",
        "ddp+pp2+zbv+layers4", "fsdp+pp2+dualpipev+layers4+mb2", "fsdp+cp2", "ddp+tp2+sp+cp2", "fsdp+tp2+cp2+lp",
        "fsdp+pp2+freeze",  # (a first stage with nothing to train, its data axis sharded over 2 ranks)
        # pipeline x context: each stage's attention gathers its pieces' keys, its embedding takes their positions
        "ddp+pp2+cp2", "fsdp+pp2+cp2+zbv+layers4"]
# checkpoints across layouts: A>B trains A to step 6, saves, and B resumes it to step 12
RESUMES = ["ddp+tp2>fsdp", "fsdp>ddp+tp2+sp+lp", "ddp+tp2>ddp+tp2", "ddp+pp2+1f1b>fsdp", "fsdp>ddp+pp2+gpipe",
           "ddp+pp2>ddp+pp2", "ddp+pp2>ddp+tp2", "ddp+pp2+zbv+layers4>fsdp+layers4", "ddp+cp2>fsdp",
           "ddp+pp2+freeze>fsdp+freeze", "ddp+compile>fsdp"]  # (a compiled run's names: the eager model's)
# ... on 4 ranks, between 2-D layouts: pp2 x fsdp2 -> tp2 x dp2 (sequence parallel), tp2 x fsdp2 -> pp2 x dp2, and
# fsdp -> pp2 x dp2 under zbv (the V's head copy of the tied weight reads the embedding's weight and optimizer state),
# pp2 x cp2 -> fsdp
RESUMES_FOUR = ["fsdp+pp2>ddp+tp2+sp", "fsdp+tp2>ddp+pp2", "fsdp+layers4>ddp+pp2+zbv+layers4", "ddp+pp2+cp2>fsdp"]
# ... and into one process: the step-6 checkpoints of these runs (tp2, pp2, pp2 x fsdp2), resumed by `single`
STEPS = ["train.steps=12", "train.eval_every=6"]  # (>= 10 steps: the bar; each launch trains ~20 jobs)
INTO_ONE = {"tp": "ddp+tp2>fsdp", "pp": "ddp+pp2+1f1b>fsdp", "pp_fsdp": "fsdp+pp2>ddp+tp2+sp"}


def load(tmp, world: int) -> dict:
    """Each variant's results and final parameters (a pipeline's stages wrote theirs apart: joined here)."""
    runs = json.loads((tmp / f"{world}.json").read_text())
    for variant, run in runs.items():
        run["params"] = {}
        for part in (tmp / str(world)).glob(f"{glob.escape(variant)}.*safetensors"):
            run["params"].update(load_file(part))
        run["pieces"] = sorted((tmp / str(world) / "pieces").glob(f"{glob.escape(run_dir(variant))}.rank*"))
        if world > 1:
            run["metrics"] = read_metrics(tmp / run_dir(variant))
    return runs


def run_dir(variant: str) -> str:
    return variant.replace(":", "_").replace(">", "_to_").replace("@", "_")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("layouts")
    script = str(SCRIPTS / "strategy_parity.py")

    def launches() -> list[subprocess.CompletedProcess]:
        return [run_cli(["launch", "--fork", "--nproc", str(world),
                         "--run-dir", str(tmp / f"launch{world}"), script, str(tmp),
                         *STEPS, *variants], tmp, timeout=400)
                for world, variants in ((2, TWO + MIXED + RESUMES), (4, FOUR + RESUMES_FOUR))]

    single, multi = run_alongside([sys.executable, script, str(tmp), *STEPS, "single", "single+layers4",
                                   "single+layers6", "single+bf16", "single+freeze", "single+layers4+freeze",
                                   "single+inductor"], tmp,
                                  launches)
    assert single.returncode == 0, single.stderr[-3000:]
    for launched in multi:
        assert launched.returncode == 0, launched.stderr[-3000:]
    resumes = {}  # one process each, side by side (one core each)
    for label, source in INTO_ONE.items():
        out = tmp / f"into_one_{label}"
        out.mkdir()
        resume = f"checkpoint.resume={tmp / run_dir(source) / 'checkpoints' / 'step_6'}"
        resumes[label] = subprocess.Popen([sys.executable, script, str(out), *STEPS, f"single@{label}", resume],
                                          cwd=tmp, env=cli_env(tmp), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True)
    one = {}
    try:
        for label, proc in resumes.items():
            _, err = proc.communicate(timeout=180)
            assert proc.returncode == 0, err[-3000:]
            one[label] = load(tmp / f"into_one_{label}", 1)[f"single@{label}"]
    finally:
        for proc in resumes.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    references = load(tmp, 1)
    return references, {2: load(tmp, 2), 4: load(tmp, 4)}, one


def test_hsdp_all_reduce_over_the_replicate_groups_is_metered(runs):
    """HSDP 2 x 2: FSDP2 all-reduces the reduce-scattered gradients over the replicate groups itself (no custom
    collective); its all-reduce hook counts the bytes (half the reduce-scatter's input) and the time, from the
    reduce-scatter's end."""
    _, multi, _ = runs
    run = multi[4]["hsdp:2"]
    numel = sum(t.numel() for t in run["params"].values()) - run["params"]["tok_emb.weight"].numel()  # tied: once
    blocks = sum(t.numel() for name, t in run["params"].items() if name.startswith("blocks."))
    # one micro-batch per rank and step (16 / (4 x 4)): the root gathered once, each block twice, fp32; the
    # gradients reduce-scattered (all of them) and then all-reduced (this rank's half)
    expected = 4 * (2 * blocks + (numel - blocks)) + 4 * numel + 4 * numel // 2
    for m in run["metrics"]:
        assert m["comm_bytes"] == pytest.approx(expected, rel=0.01), (m["comm_bytes"], expected)
        assert 0 <= m["comm_exposed_s"] <= m["comm_s"] < m["step_time_s"], m


def test_mfu_counts_the_whole_model_under_every_layout(runs):
    """A pipeline rank holds a stage, a tensor-parallel rank a shard: the FLOPs per token (tflops x world / tokens/s)
    are the whole model's on every layout, so that MFU means the same as under ddp (with model.freeze, the frozen
    model's: fewer)."""
    from disttrain.models import build_model
    from disttrain.perf import flops_per_token

    _, multi, _ = runs
    for layers, frozen in ((2, False), (4, False), (6, False), (2, True), (4, True)):
        cfg = load_config(None, [f"model.n_layer={layers}", "model.d_model=64", "model.seq_len=32",
                                 "model.freeze=tok_emb.*,pos_emb.*,blocks.0.*" if frozen else "model.freeze="])
        whole = flops_per_token(build_model(cfg.model), 32)
        for world, variants in multi.items():
            for variant, run in variants.items():
                flags = variant.partition(">")[0].split("+")
                if int(next((f[6:] for f in flags if f.startswith("layers")), 2)) != layers \
                        or ("freeze" in variant) != frozen or all(variant in multi[w] for w in multi):
                    continue  # (a variant of both launches shares its run folder, and metrics.jsonl, with the other)
                for m in run["metrics"]:
                    assert m["tflops"] * 1e12 * world / m["tokens_per_s"] == pytest.approx(whole, rel=1e-9), variant


def reference_of(references: dict, variant: str) -> dict:
    then = variant.rpartition(">")[2]
    layers = next((f"+{flag}" for flag in then.split("+") if flag.startswith("layers")), "")
    return references["single" + layers + "+freeze" * ("freeze" in then)]


def assert_same_training(got: dict, reference: dict, steps=slice(None)) -> None:
    assert got["losses"] == pytest.approx(reference["losses"][steps], abs=1e-5)
    assert got["grad_norms"] == pytest.approx(reference["grad_norms"][steps], rel=1e-4)
    for step, loss in got["eval"].items():  # 33 samples: uneven shards over the data-parallel ranks
        assert loss == pytest.approx(reference["eval"][step], abs=1e-5)
    assert got["params"].keys() == reference["params"].keys()
    for name, tensor in reference["params"].items():
        assert torch.allclose(got["params"][name], tensor, atol=1e-5), name


@pytest.mark.parametrize("world, variant", [(2, "ddp+tp2+sp"), (4, "fsdp+tp2+lp"), (4, "ddp+pp2+tp2")])
def test_weight_sync_pieces_tile_the_trained_weights(runs, world, variant):
    """What each rank sends in a weight sync (service/weights/pieces.py `local_pieces`): under tp2 x fsdp2 FSDP shards
    the tensor-parallel shards again (strided placements, gathered one tensor at a time). The ranks' pieces cover every
    element of every weight exactly once, tied names point at a sent tensor, and they equal the trained weights."""
    from safetensors import safe_open

    _, multi, _ = runs
    got = multi[world][variant]
    assert len(got["pieces"]) == world
    full, cover, aliases = {}, {}, {}
    for path in got["pieces"]:
        with safe_open(str(path), "pt") as f:
            shapes, aliases_here = (json.loads(f.metadata()[k]) for k in ("shapes", "aliases"))
            aliases.update(aliases_here)
            for key in f.keys():
                name, _, offset = key.partition("@")
                piece, start = f.get_tensor(key), [int(o) for o in offset.split(",") if o]
                full.setdefault(name, torch.zeros(shapes[name]))
                cover.setdefault(name, torch.zeros(shapes[name], dtype=torch.int32))
                where = tuple(slice(o, o + n) for o, n in zip(start, piece.shape, strict=True))
                full[name][where] = piece
                cover[name][where] += 1
    assert set(full) | set(aliases) == set(got["params"]) and set(aliases.values()) <= set(full)
    for name, tensor in full.items():
        assert bool((cover[name] == 1).all()), f"{name}: elements sent {cover[name].unique().tolist()} times"
        assert torch.equal(tensor, got["params"][name]), name


@pytest.mark.parametrize("world, variant", [(2, v) for v in TWO] + [(4, v) for v in FOUR])
def test_layout_matches_single_process(runs, world, variant):
    references, multi, _ = runs
    got = multi[world][variant]
    assert len(got["losses"]) == 12 and got["eval"].keys() == {"6", "12"}
    assert_same_training(got, reference_of(references, variant))


def test_frozen_parameters_stay_as_initialised_under_every_layout(runs):
    """model.freeze: the frozen parameters leave every layout exactly as the model was built (no update, no weight
    decay), the others train; and freezing changes the run (the references differ)."""
    from disttrain.models import build_model
    from disttrain.trainer import seed_everything

    references, multi, _ = runs
    assert references["single+freeze"]["losses"] != pytest.approx(references["single"]["losses"], abs=1e-4)
    for layers in (2, 4):
        cfg = load_config(None, [f"model.n_layer={layers}", "model.d_model=64", "model.seq_len=32",
                                 "model.freeze=tok_emb.*,pos_emb.*,blocks.0.*"])
        seed_everything(cfg.run.seed)
        built = build_model(cfg.model)
        frozen = {n for n, p in built.named_parameters() if not p.requires_grad}
        assert frozen and len(frozen) < len(list(built.parameters()))
        checked = []
        for variant, run in [*references.items(), *multi[2].items(), *multi[4].items()]:
            if "freeze" not in variant or ("layers4" in variant) != (layers == 4):
                continue
            checked.append(variant.rpartition(">")[2])
            for name, param in built.named_parameters():
                assert torch.equal(run["params"][name], param.detach()) == (name in frozen), (variant, name)
        assert len(checked) == (2 if layers == 4 else 8), checked


@pytest.mark.parametrize("variant", MIXED)
def test_layout_in_bf16_matches_single_process_in_bf16(runs, variant):
    """Mixed precision composes: the losses follow one process's bf16-mixed run as closely as ddp's do (bf16
    rounding; measured 1e-4 to 3e-4; context parallelism 1.2e-3: each rank's 16-bit partial gradient of a chunk's
    keys and values is rounded before the ranks' sum), and differ from the fp32 run (so the bf16 path really ran)."""
    references, multi, _ = runs
    got, bf16, fp32 = multi[2][variant], references["single+bf16"], references["single"]
    assert got["losses"] == pytest.approx(bf16["losses"], abs=2e-3 if "cp" in variant else 1e-3)
    assert got["losses"] != pytest.approx(fp32["losses"], abs=1e-6)


def test_single_process_learns(runs):
    """The references are real training runs (so matching them means something), and different ones."""
    references, _, _ = runs
    for name, run in references.items():  # (with the embeddings frozen, more slowly)
        assert run["losses"][-1] < run["losses"][0] - (0.25 if "freeze" in name else 1.0), name
    assert references["single"]["losses"][0] != references["single+layers4"]["losses"][0]


def test_compiled_blocks_train_as_the_eager_ones(runs):
    """parallel.compile: every compiled variant made graphs, and none hit dynamo's recompile limit (past which it
    would run the blocks eagerly and pass unseen: the script makes that fail); inductor's fused C++ kernels in one
    process follow the eager run to float32's rounding (the layouts above match one process at 1e-5 with aot_eager's
    unfused arithmetic). What the compiled blocks save for backward (inductor's partitioner chose it) is what
    `estimate-memory` counts for the eager ones, within 1% without activation checkpointing and 5% with it (seen
    -0.1% and +3.4%: the checkpointed graph keeps a little more)."""
    references, multi, _ = runs
    compiled = {v: run["graphs"] for world in (2, 4) for v, run in multi[world].items() if "compile" in v}
    assert len(compiled) == len(COMPILED) + 1 and all(graphs > 0 for graphs in compiled.values()), compiled
    inductor, eager = references["single+inductor"], references["single"]
    assert inductor["graphs"] > 0 and eager["graphs"] == 0
    assert_same_training(inductor, eager)
    (whole, estimated), (checkpointed, estimated_ac) = inductor["activations"]
    assert abs(whole / estimated - 1) < 0.01 and abs(checkpointed / estimated_ac - 1) < 0.05, inductor["activations"]
    assert checkpointed < whole / 3  # (checkpointing did hold back what the blocks save: measured, not assumed)


@pytest.mark.parametrize("world, variant", [(2, v) for v in RESUMES] + [(4, v) for v in RESUMES_FOUR])
def test_checkpoint_resumes_across_layouts(runs, world, variant):
    """Steps 7-12 after resuming (a sharded DCP checkpoint, resharded to the new layout) are the single-process
    run's steps 7-12."""
    references, multi, _ = runs
    got = multi[world][variant]
    assert len(got["losses"]) == 6
    assert_same_training(got, reference_of(references, variant), slice(6, 12))


@pytest.mark.parametrize("label", INTO_ONE)
def test_layout_checkpoint_resumes_in_one_process(runs, label):
    references, _, one = runs
    assert len(one[label]["losses"]) == 6
    assert_same_training(one[label], references["single"], slice(6, 12))


def test_mesh_coordinates():
    layout = MeshLayout(pipeline=2, replicate=1, shard=2, tensor=2)
    assert layout.world == 8 and layout.data == 2
    coords = [layout.coords(r) for r in range(8)]
    assert coords[5] == {"pp": 1, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 1}  # tensor innermost, pp outermost
    assert [layout.data_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    # one rank per data shard counts the loss: the last stage's first tensor shard
    assert [r for r in range(8) if layout.counts_loss(r)] == [4, 6]
    assert layout.describe() == "pp2 x dp_shard2 x tp2"


def test_context_ranks_read_one_shard_count_their_own_tokens_and_fold_into_the_data_axis():
    ddp = MeshLayout(1, 2, 1, 1, context=2)  # 4 ranks: 2 data shards, each sequence in 2 chunks
    assert [ddp.data_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert [ddp.coords(r)["cp"] for r in range(4)] == [0, 1, 0, 1]
    assert all(ddp.counts_loss(r) for r in range(4)) and ddp.describe() == "dp_replicate2 x cp2"
    assert ddp.mesh_shape == (1, 4, 1, 1)  # the gradients are reduced over data x context ranks
    assert MeshLayout(1, 1, 2, 1, context=2, context_sharded=True).mesh_shape == (1, 1, 4, 1)
    split = MeshLayout(1, 1, 1, 2, context=2)  # tp2 x cp2: tensor innermost
    assert [split.coords(r)["cp"] for r in range(4)] == [0, 0, 1, 1] and split.mesh_shape == (1, 2, 1, 2)
    assert [r for r in range(4) if split.counts_loss(r)] == [0, 2]  # (tensor rank 0 of each share of the sequence)
    assert [r for r in range(4) if split.counts_outputs(r)] == [0]  # (one rank of the group: the whole outputs)


@pytest.mark.parametrize("overrides, world, expected", [
    (["parallel.tensor=2"], 4, MeshLayout(1, 2, 1, 2)),  # auto -> ddp: the data axis replicates
    (["parallel.strategy=fsdp", "parallel.tensor=2"], 4, MeshLayout(1, 1, 2, 2)),
    (["parallel.strategy=hsdp", "parallel.hsdp_shard_size=2", "parallel.pipeline=2"], 8, MeshLayout(2, 2, 2, 1)),
    (["parallel.strategy=hsdp", "parallel.hsdp_shard_size=2"], 4, MeshLayout(1, 2, 2, 1)),
    (["parallel.context=2"], 4, MeshLayout(1, 2, 1, 1, context=2)),  # ddp: cp folds into the replicated axis
    (["parallel.context=2", "parallel.tensor=2"], 4, MeshLayout(1, 1, 1, 2, context=2)),
    (["parallel.strategy=fsdp", "parallel.context=2"], 4, MeshLayout(1, 1, 2, 1, context=2, context_sharded=True)),
])
def test_layout_from_settings(overrides, world, expected):
    cfg = load_config(None, ["data.global_batch_size=32", *overrides])
    assert layout_for(cfg.parallel, world) == expected
    validate(cfg, world=world)


@pytest.mark.parametrize("overrides, world, message", [
    (["parallel.tensor=2"], 3, r"parallel.pipeline x parallel.tensor x parallel.context = 1 x 2 x 1 = 2 does not "
     "divide the world size 3"),
    (["parallel.tensor=2", "parallel.context=2"], 6, r"parallel.pipeline x parallel.tensor x parallel.context = "
     "1 x 2 x 2 = 4 does not divide the world size 6"),
    (["parallel.tensor=4", "parallel.context=2", "parallel.sequence_parallel=true", "model.seq_len=12"], 8,
     r"model.seq_len = 12: a rank's share \(1/parallel.context = 1/2 of it\) is not divisible by parallel.tensor = 4"),
    (["parallel.tensor=0"], 2, r"parallel.tensor = 0: must be >= 1"),
    (["parallel.strategy=zero1", "parallel.tensor=2"], 2, "'zero1' does not compose with parallel.pipeline"),
    (["parallel.sequence_parallel=true"], 2, "sequence_parallel = true needs parallel.tensor > 1"),
    (["parallel.pipeline_split=blocks.1"], 2, "pipeline_split = 'blocks.1' needs parallel.pipeline > 1"),
    (["parallel.pipeline=2", "model.n_layer=1"], 2, "model.n_layer = 1 blocks cannot fill 2 pipeline stages"),
    (["parallel.pipeline=2", "parallel.pipeline_schedule=interleaved-1f1b", "model.n_layer=2"], 2,
     "cannot fill 4 pipeline stages"),
    (["parallel.pipeline=2", "parallel.pipeline_schedule=interleaved-1f1b", "parallel.pipeline_stages_per_rank=3",
      "model.n_layer=4"], 2, "cannot fill 6 pipeline stages"),
    (["parallel.pipeline=2", "parallel.pipeline_stages_per_rank=3"], 2, "pipeline_stages_per_rank = 3: "
     "parallel.pipeline_schedule = '1f1b' runs 1 a rank; give 1 or 0"),
    (["parallel.pipeline_stages_per_rank=2"], 2, "pipeline_stages_per_rank = 2 needs parallel.pipeline > 1"),
    (["parallel.pipeline=2", "parallel.pipeline_schedule=zbv", "parallel.pipeline_stages_per_rank=4"], 2,
     "'zbv' runs 2 a rank"),
    (["parallel.pipeline=2", "parallel.pipeline_schedule=zero-bubble", "parallel.pipeline_stages_per_rank=1"], 2,
     "'zero-bubble' runs 2 or more a rank; give 2 or more, or 0"),
    (["parallel.pipeline=2", "parallel.pipeline_microbatches=3", "data.global_batch_size=16",
      "data.micro_batch_size=4"], 2, r"pipeline_microbatches = 3, but .* = 4 micro-batches per step"),
    (["parallel.pipeline=2", "parallel.pipeline_schedule=zero-bubble", "data.global_batch_size=12",
      "data.micro_batch_size=4", "model.n_layer=4"], 2, "needs the micro-batches per step \\(3\\) to be a multiple"),
    (["parallel.strategy=deepspeed", "parallel.pipeline=2"], 2, "'deepspeed' does not compose"),
    (["parallel.pipeline=2", "parallel.pipeline_schedule=dualpipev", "model.n_layer=4", "data.global_batch_size=12",
      "data.micro_batch_size=4"], 2, "'dualpipev' needs at least as many micro-batches per step as stages \\(4\\)"),
    (["parallel.context=2", "parallel.pipeline=2", "parallel.tensor=2"], 8, "parallel.context = 2 composes with "
     "parallel.pipeline or with parallel.tensor, not with both yet"),
    (["parallel.context=3"], 4, "parallel.tensor x parallel.context = 1 x 1 x 3 = 3 does not divide the world size 4"),
    (["parallel.context=3", "model.seq_len=32"], 3, "model.seq_len = 32 is not divisible by 2 x "
     "parallel.context \\(= 6"),
    (["parallel.tensor=2", "model.n_head=3", "model.d_model=96"], 2, "model.n_head = 3 is not divisible by "
     "parallel.tensor = 2"),
    (["parallel.tensor=4", "parallel.sequence_parallel=true", "model.seq_len=30"], 4,
     "model.seq_len = 30 is not divisible by parallel.tensor = 4"),
    (["parallel.tensor=2", "parallel.grad_compression=powersgd"], 4, "powersgd.* the data axis runs through FSDP2"),
    (["parallel.tensor=2", "parallel.strategy=hsdp", "parallel.hsdp_shard_size=4"], 4,
     "hsdp_shard_size = 4 does not divide the 2 data-parallel ranks"),
    (["parallel.tensor=2", "data.global_batch_size=12", "data.micro_batch_size=4"], 4,
     r"not divisible by data.micro_batch_size x data-parallel degree = 4 x 2 = 8"),
    (["parallel.tensor=2", "parallel.compile=inductor"], 2, "parallel.compile = 'inductor' with parallel.tensor = 2: "
     "compiled tensor-parallel blocks failed"),
    (["parallel.strategy=deepspeed", "parallel.deepspeed_stage=3", "parallel.compile=inductor"], 2,
     "with DeepSpeed's ZeRO-3: its hooks on every module exceed dynamo's recompile limit"),
    (["parallel.context=2", "parallel.activation_checkpointing=true", "parallel.compile=inductor"], 2,
     "with parallel.context = 2 and activation checkpointing: the keys' gathers run between graphs"),
    (["parallel.compile=inductr"], 2, "parallel.compile = 'inductr' is not a torch.compile backend here; give one of "
     ".*inductor"),
])
def test_bad_layouts_are_one_line(overrides, world, message):
    cfg = load_config(None, overrides)
    with pytest.raises(ConfigError, match=message) as info:
        validate(cfg, world=world)
    assert "\n" not in str(info.value)


def test_bad_layout_exits_2_before_any_process_starts(tmp_path, small_gpt):
    result = run_cli(["train", "--nproc", "3", *small_gpt, "--set", "parallel.tensor=2",
                      "--set", "data.global_batch_size=12", "--set", "data.micro_batch_size=2"], tmp_path, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "does not divide the world size 3" in result.stderr
    assert "torchrun" not in result.stdout + result.stderr


def test_a_stage_without_gradients_still_joins_the_norm():
    """The gradient norm over pipeline stages is one all-reduce over them: a stage whose parameters got no gradient
    in a step contributes 0 and joins it, rather than skipping a collective its partner stage enters (a hang)."""
    from disttrain.parallel.spec import squared_norm

    zero = squared_norm([], None, torch.device("cpu"))
    assert zero.dtype == torch.float64 and zero.item() == 0.0
    assert squared_norm([torch.full((4,), 2.0), torch.ones(2)], None).item() == pytest.approx(18.0)


def _largest_stage(sizes: list[int], cuts: list[int], stages: int, first: int, last: int) -> int:
    bounds = list(zip([0, *cuts], [*cuts, len(sizes)], strict=True))
    return max(sum(sizes[a:b]) + first * (i == 0) + last * (i == stages - 1) for i, (a, b) in enumerate(bounds))


def test_stage_split_balances_parameters_and_takes_given_points():
    from disttrain.models.gpt import GPT
    from disttrain.parallel.stages import balanced_split, split_points

    assert balanced_split([10, 10, 10, 10], 2) == [2]
    assert balanced_split([10, 10, 10, 10], 2, first_extra=25) == [1]  # the embedding weighs on the first stage
    assert balanced_split([10, 10, 10, 10], 4) == [1, 2, 3]
    assert balanced_split([10] * 80, 8) == list(range(10, 80, 10))  # (a 70B model's 80 blocks: a search took ~37 s)
    assert balanced_split([10, 1, 1, 10, 1, 1], 3) == [2, 4]  # 11, 11, 2: the least largest stage
    assert balanced_split([5, 1, 5], 2) == [1]  # 5 + 6 or 6 + 5: of equal splits, the earliest cut
    rng = random.Random(0)  # against every split: the least largest stage, and of those the earliest cuts
    for _ in range(300):
        sizes = [rng.choice([1, 2, 3, 5, 10]) for _ in range(rng.randint(1, 9))]
        stages, first, last = rng.randint(1, len(sizes)), rng.choice([0, 3, 7]), rng.choice([0, 4, 10])
        every = [list(c) for c in itertools.combinations(range(1, len(sizes)), stages - 1)]
        assert balanced_split(sizes, stages, first, last) == min(
            every, key=lambda c, s=sizes, k=stages, f=first, e=last: (_largest_stage(s, c, k, f, e), c))
    with pytest.raises(ConfigError, match="4 blocks cannot fill 5 pipeline stages"):
        balanced_split([10, 10, 10, 10], 5)
    gpt = GPT(load_config(None, ["model.n_layer=4", "model.d_model=32", "model.n_head=2"]).model)
    assert split_points(gpt, 2, "") == [2]  # embedding and (tied) head weigh alike on the two ends: 2 + 2 blocks
    assert split_points(gpt, 2, "blocks.1") == [1]
    with pytest.raises(ConfigError, match="'blocks.9' is not a block of the model"):
        split_points(gpt, 2, "blocks.9")
    with pytest.raises(ConfigError, match="give 1 increasing block names"):
        split_points(gpt, 2, "blocks.1,blocks.2")


def test_a_balanced_split_whose_inner_stages_are_uneven_says_so(caplog):
    """5 GPT blocks in 4 stages: the balanced split leaves the inner stages 1 and 2 blocks long (a round of the
    schedule moves at the heavier's pace): one warning naming the counts and the fix; none for an even split, for a
    split given (the user's choice), or where not asked (the rank that does not log)."""
    from disttrain.models.gpt import GPT
    from disttrain.parallel.stages import stage_bounds, uneven_stages

    assert uneven_stages([(0, 1), (1, 3), (3, 5), (5, 6)]) == "" and uneven_stages([(0, 2), (2, 4)]) == ""
    gpt = GPT(load_config(None, ["model.n_layer=5", "model.d_model=32", "model.n_head=2"]).model)
    with caplog.at_level("WARNING", logger="disttrain.parallel.stages"):
        assert stage_bounds(gpt, 4, "", warn=True) == [(0, 1), (1, 2), (2, 4), (4, 5)]
        stage_bounds(gpt, 4, "blocks.1,blocks.2,blocks.4", warn=True)
        stage_bounds(gpt, 4, "")
        stage_bounds(gpt, 5, "", warn=True)  # (one block each)
    [record] = caplog.records
    assert "the 4 pipeline stages (parallel.pipeline x its stages per rank) hold 5 blocks unevenly: those between " \
        "the first and the last hold 1 to 2 each" in record.getMessage()
    assert "parallel.pipeline_split" in record.getMessage()


def test_a_pipeline_refuses_left_padding_rather_than_ignoring_the_mask():
    """Only token ids cross the stages (causal attention): a right-padded mask changes nothing and passes; a mask
    that hides tokens before real ones would be ignored, so it stops the step with a line that says what to do."""
    from disttrain.parallel.pipeline import check_mask

    right = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    check_mask({"attention_mask": right, "position_ids": torch.arange(4).expand(2, 4)})
    check_mask({"attention_mask": right.bool()})
    check_mask({})
    for bad in (torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]), torch.tensor([[False, True], [True, True]]),
                torch.ones(2, 1, 4, 4)):
        with pytest.raises(ConfigError, match="padding_side = 'right'") as info:
            check_mask({"attention_mask": bad})
        assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="position_ids"):  # packed sequences: positions restart inside a row
        check_mask({"position_ids": torch.tensor([[0, 1, 0, 1]])})


def test_context_parallel_gives_each_rank_two_balanced_pieces_and_refuses_a_mask_it_would_ignore():
    """Each sequence in 4 pieces over 2 ranks: rank 1 takes the second and third of every sequence-valued tensor
    and their positions, rank 0 the first and last (as many causal query-key pairs each); a per-sample value stays
    whole; a left-padded batch is refused in one line naming parallel.context (its pieces attend without a mask); a
    width that does not cut evenly is right-padded."""
    from disttrain.parallel.context import ContextParallel

    ids = torch.arange(16).reshape(2, 8)
    got = ContextParallel(None, 2, 1).shard({"input_ids": ids, "labels": ids + 1, "weight": torch.ones(2)})
    assert torch.equal(got["input_ids"], ids[:, 2:6]) and torch.equal(got["labels"], ids[:, 2:6] + 1)
    assert torch.equal(got["position_ids"], torch.tensor([[2, 3, 4, 5]] * 2))
    assert torch.equal(got["weight"], torch.ones(2))
    first = ContextParallel(None, 2, 0).shard({"input_ids": ids})
    assert torch.equal(first["position_ids"], torch.tensor([[0, 1, 6, 7]] * 2))
    pairs = [sum(p + 1 for p in ContextParallel(None, 2, r).pieces(8).tolist()) for r in range(2)]
    assert pairs[0] == pairs[1] == 36 / 2  # (each query attends to the keys up to its own position)
    for size in (2, 3):  # each rank's pieces, in rank order, put back in the sequence's order (as attend and whole do)
        held = [ContextParallel(None, size, r).pieces(12 * size) for r in range(size)]
        ordered = [held[rank][second * 6:(second + 1) * 6] for rank, second in ContextParallel(None, size, 0).owners()]
        assert torch.equal(torch.cat(ordered), torch.arange(12 * size))
    left = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1], [1] * 8])
    with pytest.raises(ConfigError, match="parallel.context > 1 attends causally without the attention mask"):
        ContextParallel(None, 2, 0).shard({"input_ids": ids, "attention_mask": left})
    # a batch padded to its longest sequence (8 tokens) is padded on to 2 x 3 equal pieces of 2: labels ignored there
    last = ContextParallel(None, 3, 2).shard({"input_ids": ids, "labels": ids})
    assert torch.equal(last["input_ids"], torch.tensor([[4, 5, 6, 7], [12, 13, 14, 15]]))
    middle = ContextParallel(None, 3, 1).shard({"input_ids": ids, "labels": ids})
    assert torch.equal(middle["input_ids"], torch.tensor([[2, 3, 0, 0], [10, 11, 0, 0]]))
    assert torch.equal(middle["labels"][:, 2:], torch.full((2, 2), -100))
    assert torch.equal(middle["position_ids"], torch.tensor([[2, 3, 8, 9]] * 2))


@pytest.mark.parametrize("pattern", ["lm_head.weight", "tok_emb.*"])
def test_either_name_of_a_tied_weight_freezes_it(pattern):
    """model.freeze matches every name of a parameter: the head's weight is the embedding's (tied), one parameter."""
    from disttrain.models import build_model

    model = build_model(load_config(None, [f"model.freeze={pattern}"]).model)
    assert model.lm_head.weight is model.tok_emb.weight
    assert [n for n, p in model.named_parameters() if not p.requires_grad] == ["tok_emb.weight"]


def test_a_sequence_parallel_pipeline_pads_a_step_to_equal_shares():
    """Batches padded to their longest row (text documents) change width from step to step; under sequence
    parallelism each tensor rank sends its share of the stream to the next stage, whose shapes the schedule fixes:
    the step's micro-batches are right-padded to a multiple of the shares (the loss reads each one's own width)."""
    import torch

    from disttrain.parallel.pipeline import _pad_cat

    ids = [torch.ones(2, 5, dtype=torch.long), torch.ones(2, 7, dtype=torch.long)]
    assert _pad_cat(ids).shape == (4, 7) and _pad_cat(ids, 4).shape == (4, 8)
    padded = _pad_cat(ids, 4)
    assert padded[:2, 5:].eq(0).all() and padded[2:, 7:].eq(0).all() and padded[:2, :5].eq(1).all()


def test_a_context_split_s_gathers_are_metered_as_the_scale_model_counts_them(runs):
    """cp2 (ddp: FSDP2's replicate): comm_bytes of a step is every fp32 gradient all-reduced once and, for each of
    its 4 micro-batches, each attention's keys and values gathered and their gradients reduce-scattered (the
    closed form the scale model prices: bench/model_split.context_calls)."""
    from disttrain.bench import predict_job
    from disttrain.config import load_config

    _, multi, _ = runs
    run = multi[2]["ddp+cp2"]
    numel = sum(t.numel() for t in run["params"].values()) - run["params"]["tok_emb.weight"].numel()  # tied: once
    cfg = load_config(None, ["model.n_layer=2", "model.d_model=64", "model.seq_len=32", "parallel.context=2"])
    shape = predict_job.counted_shape(cfg.model)
    context = sum(c[2] for c in predict_job.context_calls_of(cfg, shape, "fp32", 4))
    assert context == 2 * 4 * 4 * (4 * 32 * 64)  # (2 blocks, 4 calls each of 4 sequences' keys, fp32)
    assert {m["comm_bytes"] for m in run["metrics"]} == {4 * numel + 4 * context}
