"""The collectives of a tensor-parallel step as the scale model counts them (bench/tensor_calls.py): recorded on fake
tensors over a fake group, they are what two real ranks send in the Trainer's step, and a preset's closed form
(model_shapes.tensor_calls) is what the recording gives for a Llama."""

import json
from collections import Counter

import pytest
import torch.distributed as dist
import transformers

from conftest import SCRIPTS, run_cli
from disttrain.bench import model_shapes, tensor_calls
from disttrain.bench.scale_model import WIRE_DTYPES
from disttrain.config import load_config

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


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2).save_pretrained(directory)
    return directory


@pytest.mark.parametrize("sequence_parallel, precision, clip", [
    (False, "fp32", 1.0), (False, "bf16-true", 1.0), (True, "bf16-mixed", 1.0), (True, "bf16-true", 0.0)])
def test_a_preset_s_closed_form_is_what_a_llama_records(llama_dir, sequence_parallel, precision, clip):
    cfg = load_config(None, [f"model.name=hf:{llama_dir}", "model.seq_len=32", "parallel.tensor=2",
                             f"parallel.sequence_parallel={str(sequence_parallel).lower()}",
                             "parallel.loss_parallel=true", f"parallel.precision={precision}",
                             f"optim.grad_clip={clip}"])
    recorded = Counter((c.part, c.collective, c.nbytes, c.dtype) for c in tensor_calls.count(cfg))
    shape = model_shapes.ModelShape("llama", 1, n_layer=2, d_model=64, seq_len=32, columns=5)
    stored, compute, _ = WIRE_DTYPES[precision]
    assert Counter(model_shapes.tensor_calls(shape, stored, compute, sequence_parallel, clip > 0)) == recorded


def test_activation_checkpointing_sends_a_recomputed_forward_s_calls_again():
    plain, recomputed = (tensor_calls.count(load_config(None, [*SMALL, *extra]))
                         for extra in ([], ["parallel.activation_checkpointing=true"]))
    part = lambda calls, name: [c for c in calls if c.part == name]  # noqa: E731
    assert part(recomputed, "forward") == part(plain, "forward")
    assert len(part(recomputed, "backward")) > len(part(plain, "backward"))
    assert tensor_calls.count(load_config(None, SMALL[:-1])) == ()  # (no split: nothing)
