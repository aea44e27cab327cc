"""`disttrain ckpt export --format hf`: a Hugging Face folder from a single-process and a 2-rank fsdp checkpoint
of a tiny transformers Llama (tied and untied embeddings), loaded by `from_pretrained` with the trained logits."""

import json
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import SCRIPTS, cli_env, run_alongside, run_cli
from disttrain.checkpoint import CheckpointManager
from disttrain.cli import main

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(SCRIPTS))
from hf_llama_job import PROBE, tiny_llama  # noqa: E402

RUNS = [("one", "tied"), ("one", "untied"), ("fsdp", "tied"), ("fsdp", "untied")]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Both models trained 2 steps with a checkpoint at step 2: in one process and as fsdp on 2 ranks."""
    tmp = tmp_path_factory.mktemp("hf_runs")
    one, two = run_alongside(
        [sys.executable, str(SCRIPTS / "hf_llama_job.py"), str(tmp / "one")], tmp,
        lambda: run_cli(["launch", "--fork", "--nproc", "2",
                         "--run-dir", str(tmp / "launch"), str(SCRIPTS / "hf_llama_job.py"),
                         str(tmp / "fsdp"), "--set", "parallel.strategy=fsdp"], tmp, timeout=240))
    assert one.returncode == 0, one.stderr[-3000:]
    assert two.returncode == 0, two.stderr[-3000:]
    return tmp


def _step(trained, where, name):
    return trained / where / name / "checkpoints" / "step_2"


def _trained_logits(trained, where, name):
    from safetensors.torch import load_file

    return load_file(trained / where / name / "logits.safetensors")["logits"]


def _load(folder, **kwargs):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True, **kwargs)
    assert {k: v for k, v in info.items() if v} == {}, info  # no missing, unexpected or mismatched keys
    return model


def _saved_names(folder):
    """Weight names in a folder written by us or by `save_pretrained`."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    with safe_open(folder / "model.safetensors", "pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("where, name", RUNS)
def test_hf_export_loads_with_from_pretrained_and_gives_the_trained_logits(trained, where, name, tmp_path):
    out = tmp_path / "hf"
    assert main(["ckpt", "export", str(_step(trained, where, name)), str(out), "--format", "hf",
                 "--max-shard-size", "100KB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 4 and shards == sorted(p.name for p in out.glob("model-*-of-*.safetensors"))
    assert all((out / s).stat().st_size < 100_000 + 70_000 for s in shards)  # 100KB, or one tensor (64 KiB)
    model = _load(out)
    assert model.config.tie_word_embeddings == (name == "tied")
    assert ("lm_head.weight" in index["weight_map"]) == (name == "untied")
    if name == "tied":
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        logits = model(PROBE).logits
    torch.testing.assert_close(logits, _trained_logits(trained, where, name), atol=1e-5, rtol=0)

    # the same weight names as save_pretrained writes for this model
    reference = tiny_llama(name == "tied")
    reference.save_pretrained(tmp_path / "reference")
    assert set(index["weight_map"]) == _saved_names(tmp_path / "reference")


def test_fsdp_checkpoint_stores_tied_weights_once(trained):
    """Tied parameters are one object in the state dict (parallel/state.py), so DCP stores them once."""
    stored = json.loads((_step(trained, "fsdp", "tied") / "metadata.json").read_text())["tensors"]
    assert "model.model.embed_tokens.weight" in stored and "model.lm_head.weight" not in stored
    untied = json.loads((_step(trained, "fsdp", "untied") / "metadata.json").read_text())["tensors"]
    assert "model.lm_head.weight" in untied


@pytest.mark.parametrize("name", ["tied", "untied"])
def test_fsdp_export_reads_one_tensor_at_a_time(trained, name, tmp_path, monkeypatch):
    """Every DCP read is a one-key state dict of a model weight: never the whole state, never optimizer state."""
    import torch.distributed.checkpoint as dcp

    real_load, calls = dcp.load, []

    def recording_load(state_dict, *args, **kwargs):
        calls.append({key: t.numel() for key, t in state_dict.items()})
        return real_load(state_dict, *args, **kwargs)

    monkeypatch.setattr(dcp, "load", recording_load)
    step = _step(trained, "fsdp", name)
    assert main(["ckpt", "export", str(step), str(tmp_path / "hf"), "--format", "hf"]) == 0
    assert all(len(call) == 1 for call in calls), calls
    keys = [key for call in calls for key in call]
    skeleton = json.loads((step / "state.json").read_text())["skeleton"]
    model_keys = {ref["__tensor__"] for ref in skeleton["model"].values()}
    assert sorted(keys) == sorted(model_keys)  # each model tensor read once, nothing else
    assert max(n for call in calls for n in call.values()) == 256 * 64  # the largest one: the embedding
    monkeypatch.undo()
    _load(tmp_path / "hf")


def test_hf_config_round_trips_through_the_checkpoint(trained):
    state = CheckpointManager(_step(trained, "fsdp", "tied").parent).load(2)
    assert state["hf_config"] == json.loads(tiny_llama(True).config.to_json_string())
    state = CheckpointManager(_step(trained, "one", "untied").parent).load(2)
    assert state["hf_config"]["tie_word_embeddings"] is False and state["hf_config"]["model_type"] == "llama"


def test_a_model_that_is_not_hf_has_no_hf_config_and_transformers_stays_unimported(tmp_path):
    code = ("import sys, torch\n"
            "from disttrain.backend import create_backend\n"
            "from disttrain.config import ModelConfig, ParallelConfig\n"
            "from disttrain.models.gpt import GPT\n"
            "b = create_backend(GPT(ModelConfig(n_layer=1, d_model=32, n_head=2, seq_len=8)),\n"
            "                   lambda m: torch.optim.SGD(m.parameters(), lr=0.1), ParallelConfig(strategy='single'))\n"
            "assert 'hf_config' not in b.state_dict()\n"
            "assert 'transformers' not in sys.modules\n")
    result = subprocess.run([sys.executable, "-c", code], env=cli_env(tmp_path), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def _hf_dir_checkpoint(tmp_path, model, name: str) -> tuple:
    """A checkpoint without hf_config whose config names the model folder `hf:DIR` (the run's model.name)."""
    source = tmp_path / "source"
    model.save_pretrained(source)
    transformers.GenerationConfig(max_new_tokens=7, do_sample=False).save_pretrained(source)
    state = {"model": model.state_dict(), "step": 1, "config": {"model": {"name": name.format(source)}}}
    CheckpointManager(tmp_path / "checkpoints").save(1, state)
    return tmp_path / "checkpoints" / "step_1", source


def test_without_hf_config_the_model_name_folder_gives_config_and_generation_config(tmp_path):
    model = tiny_llama(False)
    step, source = _hf_dir_checkpoint(tmp_path, model, "hf:{}")
    out = tmp_path / "hf"
    assert main(["ckpt", "export", str(step), str(out), "--format", "hf"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert (out / "generation_config.json").read_text() == (source / "generation_config.json").read_text()
    exported = _load(out)
    assert exported.generation_config.max_new_tokens == 7
    with torch.no_grad():
        torch.testing.assert_close(exported(PROBE).logits, model.eval()(PROBE).logits, atol=1e-5, rtol=0)


def test_dtype_bf16_writes_bf16_weights_and_says_so_in_the_config(trained, tmp_path):
    step = _step(trained, "one", "untied")
    out = tmp_path / "bf16"
    assert main(["ckpt", "export", str(step), str(out), "--format", "hf", "--dtype", "bf16"]) == 0
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    model = _load(out)
    weights = CheckpointManager(step.parent).load(2)["model"]
    for key, param in model.state_dict().items():
        assert param.dtype == torch.bfloat16 and torch.equal(param, weights[key].to(torch.bfloat16)), key


def test_flat_safetensors_export_of_an_fsdp_checkpoint_loads_strictly(trained, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "model.safetensors"
    assert main(["ckpt", "export", str(_step(trained, "fsdp", "tied")), str(out)]) == 0
    model = tiny_llama(True)
    model.load_state_dict(load_file(out))  # strict: every name, lm_head.weight included
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(PROBE).logits, _trained_logits(trained, "fsdp", "tied"),
                                   atol=1e-5, rtol=0)


def _fails_with_one_line(args, capsys, expected):
    capsys.readouterr()  # earlier output (transformers' progress bars)
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err


def test_bad_input_is_one_line_and_exit_2(trained, tmp_path, capsys):
    step = _step(trained, "one", "tied")
    hf = ["--format", "hf"]
    _fails_with_one_line(["ckpt", "export", str(step.parent), str(tmp_path / "a"), *hf], capsys,
                         "is not a step_<N> checkpoint folder")
    _fails_with_one_line(["ckpt", "export", str(step), str(tmp_path / "a"), *hf, "--max-shard-size", "lots"], capsys,
                         "--max-shard-size 'lots' is not a size")
    gpt = {"model": {"w": torch.zeros(2)}, "step": 1, "config": {"model": {"name": "gpt"}}}
    CheckpointManager(tmp_path / "gpt").save(1, gpt)
    _fails_with_one_line(["ckpt", "export", str(tmp_path / "gpt" / "step_1"), str(tmp_path / "a"), *hf], capsys,
                         "is not a checkpoint of a Hugging Face model (no hf_config, model.name = 'gpt'); export "
                         "its weights with --format safetensors")
    _hf_dir_checkpoint(tmp_path / "gone", tiny_llama(False), "hf:{}-missing")
    _fails_with_one_line(["ckpt", "export", str(tmp_path / "gone" / "checkpoints" / "step_1"), str(tmp_path / "a"),
                          *hf], capsys, "config.json (from model.name) is missing; restore that folder, or export "
                         "with --format safetensors")
    shutil.copytree(step, tmp_path / "bad" / "step_2")
    (tmp_path / "bad" / "step_2" / "state.json").write_text("{}")
    assert main(["ckpt", "export", str(tmp_path / "bad" / "step_2"), str(tmp_path / "a"), *hf]) == 1
    assert "state.json: size 2 bytes, manifest says" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()


def test_an_existing_out_is_refused_unless_forced(trained, tmp_path, capsys):
    step = _step(trained, "one", "tied")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "README.md").write_text("mine")
    (out / "model-00001-of-00009.safetensors").write_text("stale")
    args = ["ckpt", "export", str(step), str(out), "--format", "hf"]
    _fails_with_one_line(args, capsys, "exists and is not empty; choose a new OUT, or pass --force")
    assert (out / "model-00001-of-00009.safetensors").read_text() == "stale"
    assert main([*args, "--force"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    _load(out)
    flat = tmp_path / "flat.safetensors"
    flat.write_text("older")
    _fails_with_one_line(["ckpt", "export", str(step), str(flat)], capsys, "exists and is not empty")
    assert main(["ckpt", "export", str(step), str(flat), "--force"]) == 0
    assert not list(tmp_path.glob(".*partial*"))  # no staging left behind
