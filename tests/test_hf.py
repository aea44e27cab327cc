"""Hugging Face causal LMs (`model.name = "hf:DIR"`, or a `PreTrainedModel` object): the step loss against
transformers' own `model(..., labels=...).loss`, how batches call the model, parity with one process under every
strategy (2 real ranks), the sharded start, and the one-line errors. Models are built from a config and saved
locally: nothing downloads."""

import glob
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import SCRIPTS, run_alongside, run_cli
from disttrain.backend import create_backend
from disttrain.config import ConfigError, ParallelConfig, load_config
from disttrain.data import GlobalSampler, build_datasets
from disttrain.models.hf import load_pretrained

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A tiny Llama (tied embeddings, rotary buffers; 4 layers: 2 ranks x 2 virtual pipeline stages) saved with
    save_pretrained."""
    directory = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(directory)
    return directory


def padded_batch(lengths: list[int], width: int, seed: int = 1) -> dict[str, torch.Tensor]:
    """Right-padded sequences of the given lengths: padding has attention_mask 0 and label -100."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (len(lengths), width), generator=g)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def disttrain_step(llama_dir, batch: dict, micro: int) -> dict:
    model = load_pretrained(f"hf:{llama_dir}")
    backend = create_backend(model, lambda m: torch.optim.SGD(m.parameters(), lr=0.0), ParallelConfig("single"))
    rows = len(batch["input_ids"])
    for start in range(0, rows, micro):
        backend.forward_backward({k: v[start:start + micro] for k, v in batch.items()}, sync=start + micro >= rows)
    return backend.optim_step()


def test_step_loss_equals_transformers_loss(llama_dir):
    """disttrain's token-summed loss over micro-batches equals transformers' loss over the whole global batch
    (which shifts aligned labels itself), with padding, for any micro-batch size and any amount of padding; so does
    the gradient (its norm). The reference is transformers' own loader and loss."""
    reference = LlamaForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    batch = padded_batch([16, 11, 16, 6], width=16)
    expected = reference(**batch).loss
    expected.backward()
    expected_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]).item()
    wider = {k: nn.functional.pad(v, (0, 8), value=-100 if k == "labels" else 0) for k, v in batch.items()}
    for micro, b in ((4, batch), (2, batch), (1, batch), (1, wider), (3, wider)):
        out = disttrain_step(llama_dir, b, micro)
        assert out["loss"] == pytest.approx(expected.item(), abs=1e-6), (micro, b is wider)
        assert out["grad_norm"] == pytest.approx(expected_norm, rel=1e-5), (micro, b is wider)
    assert out["count"] == 16 + 11 + 16 + 6 - 4  # one target fewer than tokens per sequence: the shift


def test_loaded_weights_and_buffers_equal_transformers(llama_dir):
    reference = LlamaForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    model = load_pretrained(f"hf:{llama_dir}")
    assert all(p.is_meta for p in model.parameters()) and not any(b.is_meta for b in model.buffers())
    create_backend(model, lambda m: torch.optim.SGD(m.parameters(), lr=0.0), ParallelConfig("single"))
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tie survived materialisation
    theirs = dict(reference.named_parameters()) | dict(reference.named_buffers())
    ours = dict(model.named_parameters()) | dict(model.named_buffers())
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


class Recorder(nn.Module):
    """Records the arguments of each call."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.calls = []

    def forward(self, input_ids, attention_mask=None, scale=1.0):
        self.calls.append({"input_ids": input_ids, "attention_mask": attention_mask, "scale": scale})
        return self.proj(torch.nn.functional.one_hot(input_ids, 4).float()) * scale


def test_dict_batches_call_the_model_with_the_keys_it_names():
    model = Recorder()
    backend = create_backend(model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), ParallelConfig("single"))
    ids = torch.tensor([[0, 1, 2]])
    seen = []

    def loss(outputs, batch):  # keys the forward does not name stay for the loss
        seen.append(sorted(batch))
        return outputs.sum() * batch["advantages"].sum()

    backend.forward_backward({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids,
                              "advantages": torch.ones(1)}, loss)
    call = model.calls[-1]
    assert call["attention_mask"] is not None and call["scale"] == 1.0
    assert seen == [["advantages", "attention_mask", "input_ids", "labels"]]
    backend.forward({"inputs": ids})  # no named key: the input positionally
    assert torch.equal(model.calls[-1]["input_ids"], ids)


def test_a_batch_the_forward_rejects_is_one_line():
    class NeedsPixels(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(1))

        def forward(self, input_ids, pixel_values):
            return self.w * 0

    backend = create_backend(NeedsPixels(), lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                             ParallelConfig("single"))
    with pytest.raises(ConfigError, match="needs pixel_values.*add them in your dataset or collate_fn"):
        backend.forward_backward({"input_ids": torch.zeros(1, 3, dtype=torch.long)})
    with pytest.raises(ConfigError, match="names none of"):
        backend.forward_backward({"tokens": torch.zeros(1, 3, dtype=torch.long)})


def test_labels_longer_than_inputs_are_one_line(llama_dir):
    batch = padded_batch([8, 8], width=8)
    batch["labels"] = torch.cat([batch["labels"], batch["labels"]], dim=1)
    with pytest.raises(ConfigError, match="labels of shape .* do not match the inputs"):
        disttrain_step(llama_dir, batch, micro=2)


PARITY = ["ddp", "ddp+ac", "zero1", "zero1+ac", "zero2", "zero2+ac", "fsdp", "fsdp+ac", "hsdp:1", "hsdp+ac:1",
          "deepspeed+stage2", "deepspeed+stage2+ac", "deepspeed+stage3", "deepspeed+stage3+ac",
          # tensor parallel (parallel/tensor.py: the Llama plan), with sequence parallel and the loss on split logits
          "ddp+tp2", "ddp+tp2+sp+lp",
          # two pipeline stages (parallel/pipeline.py); interleaved, zero-bubble, zbv and dualpipev: two virtual
          # stages per rank
          "ddp+pp2+1f1b", "ddp+pp2+gpipe", "ddp+pp2+i1f1b", "ddp+pp2+zb", "ddp+pp2+zbv", "ddp+pp2+dualpipev",
          # context parallel: each sequence in two chunks (HF's labels shifted before the cut), with checkpointing
          "ddp+cp2", "fsdp+cp2+ac"]
# compiled decoder layers (parallel.compile, aot_eager), checkpointed and sharded, and around a context split; trained
# first: a ZeRO-3 engine replaces torch.nn.functional.linear for the rest of the process, which they would trace
COMPILED = ["fsdp+compile+ac", "ddp+cp2+compile"]
# the embeddings (tied to the head) and the first layer frozen (model.freeze): against one process frozen alike
FROZEN = ["fsdp+freeze", "ddp+pp2+1f1b+freeze", "deepspeed+stage3+freeze"]
# 4 ranks: tp2 x fsdp2 (the sharded start), pp2 x dp2, pp2 x fsdp2 (gpipe, zero-bubble), hsdp 2 x 2
PARITY_FOUR = ["fsdp+tp2", "ddp+pp2", "fsdp+pp2+gpipe", "fsdp+pp2+zb", "hsdp:2", "ddp+pp2+tp2+sp", "fsdp+tp2+sp+cp2+ac",
               "fsdp+pp2+cp2"]  # (pipeline x context: each stage rotates its pieces' positions)


@pytest.fixture(scope="module")
def parity(llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf_parity")
    script, settings = str(SCRIPTS / "strategy_parity.py"), [f"model.name=hf:{llama_dir}", "train.steps=10"]

    def launches() -> list[subprocess.CompletedProcess]:
        return [run_cli(["launch", "--fork", "--nproc", str(world),
                         "--run-dir", str(tmp / f"launch{world}"), script, str(tmp),
                         *settings, *variants], tmp, timeout=400)
                for world, variants in ((2, COMPILED + PARITY + FROZEN), (4, PARITY_FOUR))]

    single, multi = run_alongside([sys.executable, script, str(tmp), *settings, "single", "single+freeze"], tmp,
                                  launches)
    assert single.returncode == 0, single.stderr
    for launched in multi:
        assert launched.returncode == 0, launched.stderr[-3000:]
    loaded = {}
    for world in (1, 2, 4):
        loaded[world] = json.loads((tmp / f"{world}.json").read_text())
        for variant, run in loaded[world].items():
            run["params"] = {}
            for part in (tmp / str(world)).glob(f"{glob.escape(variant)}.*safetensors"):  # a pipeline's stages
                run["params"].update(load_file(part))
    return loaded[1], {**loaded[2], **loaded[4]}  # (the two launches' variant names differ)


def test_trainer_uses_hf_label_convention(llama_dir, parity):
    """The Trainer's first step on the built-in data is transformers' loss on the same global batch of windows."""
    single = parity[0]["single"]
    cfg = load_config(None, ["model.seq_len=32", "data.global_batch_size=16"])
    train, _ = build_datasets(cfg.data, cfg.model.seq_len, aligned=True)
    indices = GlobalSampler(len(train), cfg.run.seed, cfg.data.shuffle).global_indices(0, 16)
    ids = torch.stack([train[i]["input_ids"] for i in indices])
    reference = LlamaForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    with torch.no_grad():
        expected = reference(input_ids=ids, labels=ids).loss.item()
    assert single["losses"][0] == pytest.approx(expected, abs=1e-6)
    assert single["losses"][-1] < single["losses"][0] - 0.5  # it learns


@pytest.mark.parametrize("variant", COMPILED + PARITY + PARITY_FOUR + FROZEN)
def test_hf_model_matches_single_process(parity, variant):
    one, two = parity
    single, got = one["single+freeze" if "freeze" in variant else "single"], two[variant]
    assert len(got["losses"]) == 10
    assert got["losses"] == pytest.approx(single["losses"], abs=1e-5)
    assert got["grad_norms"] == pytest.approx(single["grad_norms"], rel=1e-4)
    assert got["eval"]["10"] == pytest.approx(single["eval"]["10"], abs=1e-5)
    assert got["params"].keys() == single["params"].keys()
    for name, tensor in single["params"].items():
        assert torch.allclose(got["params"][name], tensor, atol=1e-5), name
    assert (got["graphs"] > 0) == ("compile" in variant)  # (compiled: not dynamo's eager fallback)


def test_frozen_hf_parameters_keep_their_pretrained_values(llama_dir, parity):
    """model.freeze on a Hugging Face Llama: the frozen embeddings and first layer leave training (and the sharded
    start, and a pipeline stage with nothing to train) equal to the weights file, bit for bit; the rest trains."""
    from safetensors.torch import load_file

    one, two = parity
    pretrained = load_file(llama_dir / "model.safetensors")
    frozen = {n for n in pretrained if n.startswith(("model.embed_tokens.", "model.layers.0."))}
    assert frozen and len(frozen) < len(pretrained)
    for variant, run in [("single+freeze", one["single+freeze"]), *((v, two[v]) for v in FROZEN)]:
        for name, weight in pretrained.items():
            assert torch.equal(run["params"][name], weight) == (name in frozen), (variant, name)


def test_sharded_start_reads_only_each_ranks_rows(llama_dir, tmp_path):
    """`bench startup` under fsdp at 2 ranks: each rank reads about half of the weights from disk and holds half of
    the parameters (peak memory, a figure, is reported, not asserted). Under a pipeline of 2 stages each rank reads
    and holds its own stage only: blocks, and the embedding or the head (the tiny Llama's are tied: the last stage
    reads the embedding's tensor for it)."""
    out = tmp_path / "bench"
    result = run_cli(["bench", "startup", "--model", f"hf:{llama_dir}", "--strategies", "fsdp,ddp+pp2",
                      "--out", str(out)], tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "startup.json").read_text())
    full = report["full_fp32_bytes"]
    for strategy, low, high in (("fsdp", 0.4, 0.6), ("ddp+pp2", 0.2, 0.8)):
        rows = [r for r in report["rows"] if r["strategy"] == strategy]
        assert [r["rank"] for r in rows] == [0, 1]
        for row in rows:
            assert low * full < row["weight_bytes_read"] < high * full
            assert row["parameter_bytes_held"] < high * full
        assert sum(r["weight_bytes_read"] for r in rows) >= full
    assert "x the full fp32 weights" in (out / "startup.md").read_text()


@pytest.mark.parametrize("name, expected", [
    ("hf:meta-llama/Llama-3.2-1B", "never downloads: fetch it first"),
    ("hf:/nonexistent/model", "is not a local directory"),
])
def test_hub_ids_and_missing_directories_are_one_line(tmp_path, name, expected):
    result = run_cli(["train", "--set", f"model.name={name}"], tmp_path, timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0] and "Traceback" not in result.stderr
    assert not (tmp_path / "runs").exists()


def test_directory_without_config_is_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    result = run_cli(["train", "--set", f"model.name=hf:{tmp_path / 'empty'}"], tmp_path, timeout=60)
    assert result.returncode == 2 and "has no config.json" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("micro, seq_len, freeze", [(4, 32, ""), (2, 64, ""),
                                                    (4, 32, "model.embed_tokens.*,model.layers.0.*")])
def test_memory_estimate_matches_measurement(llama_dir, checkpointing, micro, seq_len, freeze):
    """`estimate-memory` for an HF model: parameters, gradients and optimizer state exact, activations within 10%
    of what autograd really saves (seen: exact), also with the embeddings (tied to the head) and the first layer
    frozen, which keep none (model.freeze)."""
    from disttrain.data import collate
    from disttrain.memory import estimate, measure
    from disttrain.models import build_model
    from disttrain.optim import optimizer_factory

    cfg = load_config(None, [f"model.name=hf:{llama_dir}", f"model.seq_len={seq_len}", "parallel.strategy=single",
                             f"data.micro_batch_size={micro}", f"model.freeze={freeze}",
                             f"parallel.activation_checkpointing={str(checkpointing).lower()}"])
    train, _ = build_datasets(cfg.data, seq_len, aligned=True)
    measured = measure(lambda: create_backend(build_model(cfg.model), optimizer_factory(cfg.optim), cfg.parallel),
                       collate([train[i] for i in range(micro)]))
    est = estimate(cfg, 1)
    assert (est.params, est.grads, est.optimizer) == (measured["params"], measured["grads"], measured["optimizer"])
    activations = est.activations_ac if checkpointing else est.activations
    assert activations == pytest.approx(measured["activations"], rel=0.10)


def test_training_service_runs_an_hf_model_sharded(llama_dir):
    """`as_service("hf:DIR", strategy="fsdp")` on 2 workers: the same losses as create_backend in this process."""
    import asyncio

    from disttrain.service import TrainingService

    batches = [padded_batch([16, 12, 16, 9], width=16, seed=s) for s in range(3)]
    model = load_pretrained(f"hf:{llama_dir}")
    local = create_backend(model, lambda m: torch.optim.SGD(m.parameters(), lr=0.5), ParallelConfig("single"))
    expected = []
    for batch in batches:
        local.forward_backward(batch)
        expected.append(local.optim_step()["loss"])

    async def remote() -> tuple[list[float], dict]:
        service = await TrainingService.options(nproc=2, threads_per_rank=1).as_service(
            f"hf:{llama_dir}", strategy="fsdp", optimizer={"name": "sgd", "lr": 0.5, "beta1": 0.0,
                                                           "weight_decay": 0.0, "grad_clip": 0.0})
        try:
            losses = []
            for batch in batches:
                await service.forward_backward(batch)
                losses.append((await service.optim_step())["loss"])
            return losses, await service.forward({"input_ids": batches[0]["input_ids"]})
        finally:
            await service.shutdown()

    losses, outputs = asyncio.run(remote())
    assert losses == pytest.approx(expected, abs=1e-5)
    with torch.no_grad():
        logits = model(input_ids=batches[0]["input_ids"]).logits
    assert torch.allclose(outputs["logits"], logits, atol=1e-5)


def test_verify_runs_an_hf_model(llama_dir, tmp_path):
    result = run_cli(["verify", "--set", f"model.name=hf:{llama_dir}", "--set", "model.seq_len=32",
                      "--set", "data.global_batch_size=8", "--set", "data.micro_batch_size=2",
                      "--strategies", "fsdp,zero2", "--steps", "3"], tmp_path, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "fsdp" in result.stdout and "zero2" in result.stdout


def test_bench_predict_counts_an_hf_model_from_its_module_tree(llama_dir, tmp_path):
    """`bench predict` of `hf:DIR`, built on the meta device: its blocks, what model.freeze leaves to train, and its
    FLOPs (perf.flops_by_unit) become the scale model's units."""
    from disttrain.bench.predict_job import counted_shape
    from disttrain.cli.main import main as cli
    from disttrain.models import build_model
    from disttrain.perf import flops_per_token

    cfg = load_config(None, [f"model.name=hf:{llama_dir}", "model.seq_len=32",
                             "model.freeze=model.embed_tokens.*,model.layers.0.*"])
    shape, model = counted_shape(cfg.model), build_model(cfg.model)
    assert shape.name == "LlamaForCausalLM of 4 blocks" and len(shape.units()) == 5
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert shape.trained_params == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert shape.units()[1].backward_flops == 0 and shape.flops_per_token() == flops_per_token(model, 32)
    assert cli(["bench", "predict", "--set", f"model.name=hf:{llama_dir}", "--set", "model.seq_len=32",
                "--strategy", "fsdp", "--gpus", "8,64", "--out", str(tmp_path)]) == 0
    assert "| fsdp | 64 |" in (tmp_path / "predict.md").read_text()
