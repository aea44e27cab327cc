"""The collectives of a tensor-parallel step as the scale model counts them (bench/tensor_calls.py): recorded on fake
tensors over a fake group, they are what two real ranks send in the Trainer's step, and a preset's closed form
(model_shapes.tensor_calls) is what the recording gives for a Llama. A context split's, in closed form
(bench/model_split.context_calls), are what two real ranks send too."""

import json
from collections import Counter
from dataclasses import replace

import pytest
import torch.distributed as dist
import transformers

from conftest import SCRIPTS, run_cli
from disttrain.bench import model_shapes, model_split, predict_job, tensor_calls
from disttrain.bench import scale_model as sm
from disttrain.bench.interconnect import ITEMSIZE
from disttrain.bench.scale_model import WIRE_DTYPES
from disttrain.config import load_config

SHAPE, LLAMA4 = (model_shapes.llama_shape("llama", layers, 64, 128, 2, 4, 256, 32) for layers in (3, 4))
"""The llama_dir and llama4_dir models as presets (closed form)."""
SMALL = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.seq_len=16", "parallel.tensor=2"]
VARIANTS = {"plain": [], "sp": ["parallel.sequence_parallel=true"],
            "bf16+lp": ["parallel.precision=bf16-mixed", "parallel.loss_parallel=true"],
            "ac+sp": ["parallel.activation_checkpointing=true", "parallel.sequence_parallel=true"]}


def test_the_count_is_what_two_ranks_send_in_the_trainer_s_step(tmp_path):
    """Two micro-batches of two sequences: each forward's and backward's calls twice at twice a sequence's size, the
    step's once (the clip's norm; under sequence parallelism the norms' partial gradients, summed by the clip and by
    the optimizer)."""
    result = run_cli(["launch", "--fork", "--nproc", "2", "--run-dir", str(tmp_path / "launch"),
                      str(SCRIPTS / "tensor_calls_job.py"), str(tmp_path), *VARIANTS], tmp_path, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    sent = json.loads((tmp_path / "calls.json").read_text())
    for variant, settings in VARIANTS.items():
        counted = Counter()
        for c in tensor_calls.count(load_config(None, [*SMALL, *settings])):
            if c.part == "step":
                counted[(c.collective, c.nbytes, c.dtype)] += 1
            else:
                counted[(c.collective, 2 * c.nbytes, c.dtype)] += 2
        assert Counter((kind, nbytes, dtype) for _, kind, nbytes, dtype in sent[variant]) == counted, variant
    assert not dist.is_initialized()  # (the count's fake group is gone)


def _llama(tmp_path_factory, layers: int):
    directory = tmp_path_factory.mktemp("llama")
    transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return _llama(tmp_path_factory, 3)


@pytest.fixture(scope="module")
def llama4_dir(tmp_path_factory):
    return _llama(tmp_path_factory, 4)


@pytest.mark.parametrize("sequence_parallel, precision, clip, extra", [
    (False, "fp32", 1.0, []), (False, "bf16-true", 1.0, []), (True, "bf16-mixed", 1.0, []),
    (True, "bf16-true", 0.0, []), (False, "bf16-mixed", 1.0, ["parallel.loss_parallel=false"]),
    (False, "fp32", 1.0, ["parallel.activation_checkpointing=true"]),
    (True, "bf16-mixed", 1.0, ["parallel.activation_checkpointing=true"])])
@pytest.mark.parametrize("data_axis", [False, True])
def test_a_preset_s_closed_form_is_what_a_llama_records(llama_dir, sequence_parallel, precision, clip, extra,
                                                        data_axis):
    """Three blocks (a block count the closed form cannot get right by accident); beside a data axis the stream's
    calls in FSDP2's gathered dtype."""
    cfg = load_config(None, [f"model.name=hf:{llama_dir}", "model.seq_len=32", "parallel.tensor=2",
                             f"parallel.sequence_parallel={str(sequence_parallel).lower()}",
                             "parallel.loss_parallel=true", f"parallel.precision={precision}",
                             f"optim.grad_clip={clip}", *extra])
    recorded = Counter((c.part, c.collective, c.nbytes, c.dtype) for c in tensor_calls.count(cfg, "", data_axis))
    assert Counter(predict_job.tensor_calls_of(cfg, SHAPE, precision, 1.0, data_axis)) == recorded


@pytest.mark.parametrize("sequence_parallel, precision, schedule", [
    (False, "bf16-mixed", "1f1b"), (True, "bf16-mixed", "1f1b"), (True, "fp32", "interleaved-1f1b")])
@pytest.mark.parametrize("data_axis", [False, True])
def test_each_pipeline_rank_s_calls_are_its_stages_recorded(llama4_dir, sequence_parallel, precision, schedule,
                                                           data_axis):
    """A pipeline with a tensor split: each stage recorded as the pipeline runs it (the embedding's calls on the
    first, the gathered logits on the last, a later stage fed its share of the stream) and each rank's step over its
    stages together; in closed form for the stages' blocks and ends, and the ranks' steps, equal to them (4 blocks:
    a rank's 2, or 2 stages of 1)."""
    settings = [f"model.name=hf:{llama4_dir}", "model.seq_len=32", "parallel.tensor=2", "parallel.pipeline=2",
                f"parallel.pipeline_schedule={schedule}", f"parallel.precision={precision}",
                f"parallel.sequence_parallel={str(sequence_parallel).lower()}"]
    cfg = load_config(None, settings)
    from disttrain.parallel import mesh

    recorded = tensor_calls.count_stages(cfg, "", data_axis)
    count = mesh.stage_count(cfg.parallel, 2)
    assert (len(recorded.stages), len(recorded.steps)) == (count, 2)
    assert any(c.collective == "all_gather" and c.nbytes == 32 * 256 * ITEMSIZE[WIRE_DTYPES[precision][1]]
               for c in recorded.stages[-1])  # (the logits, gathered whole: no loss parallel under a pipeline)
    plain = lambda calls: Counter((c.part, c.collective, c.nbytes, c.dtype) for c in calls)  # noqa: E731
    closed = predict_job.stage_calls_of(cfg, LLAMA4, precision, 1.0, data_axis)
    assert [Counter(calls) for calls in closed.stages] == [plain(calls) for calls in recorded.stages]
    assert [Counter(calls) for calls in closed.steps] == [plain(calls) for calls in recorded.steps]


def test_activation_checkpointing_sends_a_recomputed_forward_s_calls_again():
    plain, recomputed = (tensor_calls.count(load_config(None, [*SMALL, *extra]))
                         for extra in ([], ["parallel.activation_checkpointing=true"]))
    part = lambda calls, name: [c for c in calls if c.part == name]  # noqa: E731
    assert part(recomputed, "forward") == part(plain, "forward")
    assert len(part(recomputed, "backward")) > len(part(plain, "backward"))
    assert tensor_calls.count(load_config(None, SMALL[:-1])) == ()  # (no split: nothing)


def test_each_stage_s_count_is_what_its_ranks_send_in_the_trainer_s_step(tmp_path, llama4_dir):
    """Four ranks. A pipeline of 2 stages each split over 2: the GPT (also interleaved, 2 stages a rank whose step
    norms them together), and a Llama under sequence parallelism in bf16-mixed (its stages' blocks take their rank's
    share of the sequence): each rank sends its stages' recorded calls, 2 micro-batches of 2 sequences each, and its
    step's once; an evaluation of 15 tokens through the Llama's stages gives the last stage's ranks logits 15 wide.
    And a tensor split of 2 beside a data axis of 2 in bf16-mixed (FSDP2's replicate): the forward's and backward's
    calls as recorded with the data axis, one micro-batch of 2 sequences."""
    split = ["parallel.pipeline=2", "parallel.tensor=2"]
    variants = {"gpt": [*SMALL[:-1], *split],
                "gpt-interleaved": [*SMALL[:-1], *split, "model.n_layer=4",
                                    "parallel.pipeline_schedule=interleaved-1f1b"],
                "llama": [f"model.name=hf:{llama4_dir}", "model.seq_len=16", "parallel.sequence_parallel=true",
                          "parallel.precision=bf16-mixed", *split],
                "gpt-data": [*SMALL, "parallel.precision=bf16-mixed"]}
    result = run_cli(["launch", "--fork", "--nproc", "4", "--run-dir", str(tmp_path / "launch"),
                      str(SCRIPTS / "stage_calls_job.py"), str(tmp_path),
                      *(f"{name}:{','.join(settings)}" for name, settings in variants.items())], tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    from disttrain.parallel import mesh

    for rank in range(4):
        sent, widths = json.loads((tmp_path / f"calls-{rank}.json").read_text()).values()
        # (evaluation through the stages: 15 tokens, padded to equal shares of a sequence-parallel stream and cut back)
        assert widths["llama"] == ([2, 15, 256] if rank >= 2 else [0]), rank
        for name, settings in variants.items():
            cfg, counted = load_config(None, settings), Counter()
            if name == "gpt-data":
                got = Counter((k, b, d) for _, k, b, d in sent[name])
                assert got == Counter((c.collective, c.nbytes * (1 if c.part == "step" else 2), c.dtype)
                                      for c in tensor_calls.count(cfg, "", True)), (rank, name)
                continue
            recorded = tensor_calls.count_stages(cfg)
            pipeline_rank = rank // 2  # (tensor innermost)
            for s in mesh.stages_of(pipeline_rank, 2, len(recorded.stages), cfg.parallel.pipeline_schedule):
                counted.update((c.collective, 2 * c.nbytes, c.dtype) for c in recorded.stages[s] for _ in range(2))
            counted.update((c.collective, c.nbytes, c.dtype) for c in recorded.steps[pipeline_rank])
            assert Counter((kind, nbytes, dtype) for _, kind, nbytes, dtype in sent[name]) == counted, (rank, name)


def test_the_context_split_s_calls_are_what_two_ranks_send_in_the_trainer_s_step(tmp_path, llama_dir):
    """Two ranks, parallel.context = 2, two micro-batches of two sequences of 16 tokens: the GPT in fp32 under
    activation checkpointing (each attention's keys and values gathered again in backward), and a Llama of grouped
    keys (2 key-value heads of 4) in bf16-mixed (keys gathered in bf16, their gradients reduced in float32), each as
    the closed form of its counted model gives them; the Llama's preset gives the same."""
    variants = {"gpt-ac": ["model.n_layer=2", "model.d_model=32", "model.n_head=2",
                           "parallel.activation_checkpointing=true"],
                "llama-bf16": [f"model.name=hf:{llama_dir}", "parallel.precision=bf16-mixed"]}
    result = run_cli(["launch", "--fork", "--nproc", "2", "--run-dir", str(tmp_path / "launch"),
                      str(SCRIPTS / "context_calls_job.py"), str(tmp_path),
                      *(f"{name}:{','.join(settings)}" for name, settings in variants.items())], tmp_path, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in range(2):
        sent = json.loads((tmp_path / f"calls-{rank}.json").read_text())
        for name, settings in variants.items():
            cfg = load_config(None, ["model.seq_len=16", "parallel.context=2", *settings])
            shape = predict_job.counted_shape(cfg.model)
            closed = predict_job.context_calls_of(cfg, shape, cfg.parallel.precision, 2)
            assert Counter((kind, nbytes, dtype) for _, kind, nbytes, dtype in sent[name]) == Counter(
                (kind, nbytes, dtype) for _, kind, nbytes, dtype in closed * 2), (rank, name)
            assert len(closed) == 4 * shape.n_layer + 2 * shape.n_layer * cfg.parallel.activation_checkpointing
    llama = load_config(None, ["model.seq_len=16", "parallel.context=2", *variants["llama-bf16"]])
    assert predict_job.context_calls_of(llama, replace(SHAPE, seq_len=16), "bf16-mixed", 2) == \
        predict_job.context_calls_of(llama, predict_job.counted_shape(llama.model), "bf16-mixed", 2)


def test_a_tensor_and_context_split_s_calls_are_what_four_ranks_send(tmp_path):
    """tp2 x cp2 (4 ranks, the GPT in fp32, two micro-batches of two sequences of 16 tokens): each rank sends the
    tensor split's recorded calls for its share of a sequence (1/2 of them) and the context split's for its heads'
    keys and values (1/2 of them), as the scale model prices them (`tensor_calls_of`, `context_calls_of`). pp2 x cp2
    (3 blocks, in the same launch): each rank sends the context calls of its stage's blocks
    (`model_split.stage_context_calls` of disttrain's split, `predict_job.pipeline_stages`) and, to the other
    stage, each micro-batch's stream (activations forward, their gradients back) cut to its pieces: 1/2 of a
    sequence's (`send_bytes`)."""
    settings = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "parallel.tensor=2"]
    staged = ["model.n_layer=3", "model.d_model=32", "model.n_head=2", "parallel.pipeline=2"]
    result = run_cli(["launch", "--fork", "--nproc", "4", "--run-dir", str(tmp_path / "launch"),
                      str(SCRIPTS / "context_calls_job.py"), str(tmp_path), f"tp:{','.join(settings)}",
                      f"pp:{','.join(staged)}"], tmp_path, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    cfg = load_config(None, ["model.seq_len=16", "parallel.context=2", "data.global_batch_size=4", *staged])
    shape = predict_job.counted_shape(cfg.model)
    split = predict_job.pipeline_stages(cfg, shape, "fp32", True)
    work = sm.Workload(shape, 1.0, 1, context=2, pipeline=2, stages=split.stages,
                       context_calls=predict_job.context_calls_of(cfg, shape, "fp32", 2))
    blocks = []
    for rank in range(4):
        sent = json.loads((tmp_path / f"calls-{rank}.json").read_text())["pp"]
        stage = split.stages[rank // 2]  # (the pipeline the outer axis: ranks 0, 1 hold the first stage)
        blocks.append(stage.n_layer)
        expected = Counter((kind, nbytes, dtype)
                           for _, kind, nbytes, dtype in model_split.stage_context_calls(work, stage) * 2)
        expected["send", split.send_bytes * 2, "float32"] += 2  # (2 micro-batches of 2 sequences)
        assert Counter((kind, nbytes, dtype) for _, kind, nbytes, dtype in sent) == expected, rank
    assert split.send_bytes == 16 * 32 * 4 / 2  # (a sequence's stream, fp32: each rank its half)
    assert sorted(set(blocks)) == [1, 2]  # (stages of unequal blocks: each rank's own)
    cfg = load_config(None, ["model.seq_len=16", "parallel.context=2", *settings])
    shape = predict_job.counted_shape(cfg.model)
    expected = Counter()
    for part, kind, nbytes, dtype in predict_job.tensor_calls_of(cfg, shape, "fp32", 2, True):
        expected[kind, nbytes, dtype] += 1 if part == "step" else 2
    for _, kind, nbytes, dtype in predict_job.context_calls_of(cfg, shape, "fp32", 2):
        expected[kind, nbytes, dtype] += 2
    for rank in range(4):
        sent = json.loads((tmp_path / f"calls-{rank}.json").read_text())["tp"]
        assert Counter((kind, nbytes, dtype) for _, kind, nbytes, dtype in sent) == expected, rank
