from pathlib import Path

import pytest

from disttrain.config import Config, ConfigError, describe, dumps_toml, load_config, save_config, validate


def _cfg(*overrides: str) -> Config:
    return load_config(None, list(overrides))


def test_toml_file_then_overrides_in_that_order(tmp_path: Path):
    path = tmp_path / "job.toml"
    path.write_text('[optim]\nlr = 0.5\nname = "sgd"\n[run]\nname = "exp"\n')
    cfg = load_config(path, ["optim.lr=1e-3", "train.steps=7", "log.progress=false"])
    assert (cfg.optim.lr, cfg.optim.name, cfg.run.name, cfg.train.steps) == (1e-3, "sgd", "exp", 7)
    assert cfg.log.progress is False and cfg.run_dir == Path("runs/exp")


def test_resolved_config_round_trips_through_toml(tmp_path: Path):
    cfg = _cfg("optim.lr=0.25", "model.name=pkg.mod:make", "data.source=some file.txt", "dist.timeout_s=12")
    save_config(cfg, tmp_path / "config.toml")
    again = load_config(tmp_path / "config.toml")
    assert again == cfg and again.hash() == cfg.hash()
    assert dumps_toml(again) == (tmp_path / "config.toml").read_text()


def test_every_setting_is_documented():
    rows = describe()
    assert len(rows) > 40
    undocumented = [key for key, _, _, doc in rows if len(doc) < 10]
    assert not undocumented


@pytest.mark.parametrize("override, message", [
    ("optim.lrr=1", "did you mean 'lr'"),
    ("optimm.lr=1", "did you mean 'optim'"),
    ("train.steps=abc", "expected int"),
    ("optim.lr=true", "expected float"),
])
def test_bad_names_and_types_are_named(override, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(override)


@pytest.mark.parametrize("overrides, world, gpus, message", [
    (["data.global_batch_size=30", "data.micro_batch_size=4"], 2, 0,
     r"data.global_batch_size = 30 is not divisible by .* 4 x 2 = 8; .*multiple of 8 \(e.g. 24 or 32\)"),
    (["parallel.strategy=dpp"], 1, 0, "did you mean 'ddp'"),
    (["parallel.strategy=single"], 2, 0, "use parallel.strategy = 'ddp'"),
    (["train.steps=0"], 1, 0, "train.steps = 0: must be > 0"),
    (["data.source=/nonexistent/file.txt"], 1, 0, "file not found"),
    (["model.d_model=100", "model.n_head=3"], 1, 0, "not divisible by model.n_head"),
    (["dist.device=cuda"], 1, 0, "no CUDA GPU is visible"),
    (["dist.backend=nccl"], 1, 0, "needs CUDA GPUs"),
    (["dist.nproc=4"], 4, 2, "this node has 2 GPU"),
    (["checkpoint.every=-1"], 1, 0, "checkpoint.every = -1: must be >= 0"),
    (["checkpoint.resume=nowhere"], 1, 0, "checkpoint.resume = .nowhere.: no such checkpoint folder"),
    (["checkpoint.best_mode=lowest"], 1, 0, "checkpoint.best_mode = .lowest. is not known"),
    (["optim.lr=-1"], 1, 0, "optim.lr = -1.0"),
    (["parallel.strategy=hsdp", "parallel.hsdp_shard_size=3"], 4, 0, "hsdp_shard_size = 3 does not divide"),
    (["parallel.strategy=ddp", "parallel.cpu_offload=true"], 2, 2,
     r"cpu_offload = true needs a strategy that uses it \(zero2, fsdp, hsdp, deepspeed\), not 'ddp'"),
    (["parallel.strategy=ddp", "parallel.fsdp_prefetch=2"], 2, 0,
     r"fsdp_prefetch = 2 needs a strategy that uses it \(zero2, fsdp, hsdp\)"),
    (["parallel.strategy=fsdp", "parallel.fsdp_prefetch=-1"], 2, 0, "fsdp_prefetch = -1: must be >= 0"),
    (["parallel.strategy=fsdp", "parallel.deepspeed_config=ds.json"], 2, 0, "set parallel.strategy = 'deepspeed'"),
    (["parallel.strategy=deepspeed", "parallel.deepspeed_stage=4"], 2, 0, "deepspeed_stage = 4: must be 0, 1, 2 or 3"),
    (["parallel.strategy=deepspeed", "parallel.deepspeed_stage=0", "parallel.cpu_offload=true"], 2, 0,
     "needs ZeRO stage 1, 2 or 3"),
    (["parallel.strategy=deepspeed", "parallel.precision=bf16-true"], 2, 0, "fp32 master copy of every partition"),
    (["parallel.strategy=deepspeed", "parallel.deepspeed_config=/nonexistent.json"], 2, 0, "file not found"),
    (["parallel.strategy=ddp", "parallel.static_graph=true"], 2, 0,  # 32 / (8 x 2): torch's DDP would crash
     r"static_graph = true with 2 micro-batches .*pytorch#143580.*static_graph = false, or data.micro_batch_size = 16"),
    (["parallel.strategy=zero1", "parallel.static_graph=true", "data.micro_batch_size=4"], 2, 0,
     r"static_graph = true with 4 micro-batches"),
    (["parallel.strategy=ddp", "parallel.pipeline=2", "parallel.bucket_cap_mb=100"], 4, 0,
     r"parallel.bucket_cap_mb = 100.0 has no effect under parallel.pipeline .*FSDP2's replicate.*remove"),
])
def test_validate_names_setting_value_and_fix(overrides, world, gpus, message):
    cfg = _cfg(*overrides)
    with pytest.raises(ConfigError, match=message) as info:
        validate(cfg, gpu_count=gpus, world=world)
    assert "\n" not in str(info.value)


def test_empty_data_file_is_refused(tmp_path: Path):
    empty = tmp_path / "empty.txt"
    empty.touch()
    with pytest.raises(ConfigError, match="the file is empty"):
        validate(_cfg(f"data.source={empty}"))


def test_valid_configs_pass():
    validate(_cfg())
    validate(_cfg("parallel.strategy=fsdp", "parallel.cpu_offload=true", "parallel.fsdp_prefetch=2"), world=2)
    validate(_cfg("dist.nproc=2", "data.global_batch_size=32", "data.micro_batch_size=4"))
    validate(_cfg("dist.nproc=2"), gpu_count=2)  # on GPUs: as many processes as GPUs is fine


def test_docs_config_reference_is_current():
    from disttrain.cli.docs import config_reference

    path = Path(__file__).resolve().parents[1] / "docs" / "config.md"
    assert path.read_text() == config_reference(), "run: python -m disttrain.cli.docs > docs/config.md"


@pytest.mark.parametrize("spelling, canonical", [
    ("bf16", "bf16-mixed"), ("bf16-mixed", "bf16-mixed"), ("16", "fp16-mixed"), ("16-mixed", "fp16-mixed"),
    ("fp16", "fp16-mixed"), ("32", "fp32"), ("32-true", "fp32"), ("fp32", "fp32"), ("no", "fp32"),
    ("bf16-true", "bf16-true")])
def test_precision_aliases_become_the_canonical_name_when_read(tmp_path, spelling, canonical):
    assert load_config(None, [f"parallel.precision={spelling}"]).parallel.precision == canonical
    path = tmp_path / "c.toml"
    path.write_text(f'[parallel]\nprecision = "{spelling}"\n')
    assert load_config(path).parallel.precision == canonical


@pytest.mark.parametrize("spelling", ["half", "16-true", "fp16-true", "fp64"])
def test_unknown_precision_is_explained_by_meaning(spelling):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"parallel.precision={spelling}"])
    message = str(err.value)
    assert "did you mean" not in message and "\n" not in message
    assert "'bf16-mixed' = float32 weights, forward under bfloat16 autocast" in message
    assert "'bf16-true' = bfloat16 weights" in message
    cfg = Config()
    cfg.parallel.precision = spelling  # set in Python, past the parser: validate says the same
    with pytest.raises(ConfigError, match="is not known.*choose by meaning"):
        validate(cfg)


def test_precision_meanings_cover_exactly_the_policies():
    from disttrain.precision import PRECISION_MEANINGS, PRECISIONS

    assert tuple(PRECISION_MEANINGS) == PRECISIONS
