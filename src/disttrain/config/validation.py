"""Validation: pure checks on a configuration's values (plus whether the files it names exist), before any process
starts. Each names the setting, the value and the fix, in one line (ConfigError)."""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path

from disttrain.config.sections import CHOICES, Config, DataConfig, ParallelConfig, suggest
from disttrain.errors import ConfigError
from disttrain.parallel import mesh, registry
from disttrain.precision import PRECISIONS, canonical_precision

TOKEN_FILE_SUFFIXES = (".bin", ".npy")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _check_choice(key: str, value: str, options: tuple[str, ...] | list[str]) -> None:
    if value not in options:
        raise ConfigError(f"{key} = {value!r} is not known; {suggest(value, list(options))}")


def uses_cuda(cfg: Config, gpu_count: int) -> bool:
    return cfg.dist.device == "cuda" or (cfg.dist.device == "auto" and gpu_count > 0)


def validate(cfg: Config, gpu_count: int = 0, world: int | None = None) -> None:
    """Raise ConfigError (one line: setting, value, fix) for the first impossible setting.

    `gpu_count` is passed in rather than probed so that this stays a pure function of its inputs.
    `world` defaults to `dist.nproc` (the launcher passes the real world size on a running job).
    """
    # first: the world size divides the batch below
    _check(cfg.dist.nproc >= 1, f"dist.nproc = {cfg.dist.nproc}: must be >= 1; use --nproc 1 or more")
    world = cfg.dist.nproc if world is None else world
    _check(world >= 1, f"world size {world}: must be >= 1; use --nproc 1 or more")
    for key, options in CHOICES.items():
        section, name = key.split(".")
        _check_choice(key, getattr(getattr(cfg, section), name), options)
    _validate_run(cfg)
    validate_model(cfg)
    layout = mesh.layout_for(cfg.parallel, world)  # the data-parallel degree divides the batch
    _validate_data(cfg, layout.data, "world size" if layout.data == world else "data-parallel degree")
    _validate_optim_train(cfg)
    if cfg.parallel.precision not in PRECISIONS:  # set in Python, not through the config's parser
        canonical_precision(cfg.parallel.precision)  # raises for an unknown name, saying what each means
        raise ConfigError(f"parallel.precision = {cfg.parallel.precision!r}: use the canonical name "
                          f"'{canonical_precision(cfg.parallel.precision)}'")
    _validate_parallel(cfg, world, layout)
    _validate_checkpoint(cfg)
    _validate_dist(cfg, gpu_count, world)
    _validate_log(cfg)
    if cfg.log.tensorboard:
        import importlib.util

        _check(importlib.util.find_spec("tensorboard") is not None,
               "log.tensorboard = true but the tensorboard package is not installed; "
               "pip install 'disttrain[tensorboard]' or set log.tensorboard = false")


def profile_range(text: str) -> tuple[int, int] | None:
    """`log.profile_steps` as (first, last) step, or None when empty; ConfigError naming the setting otherwise."""
    if not text.strip():
        return None
    match = re.fullmatch(r"(\d+)(?:-(\d+))?", text.strip())
    out = (int(match[1]), int(match[2] or match[1])) if match else (0, 0)
    _check(1 <= out[0] <= out[1], f"log.profile_steps = {text!r}: give steps as \"FIRST-LAST\" or \"N\" (steps >= 1), "
           "e.g. log.profile_steps = \"10-12\"")
    return out


def _validate_log(cfg: Config) -> None:
    span = profile_range(cfg.log.profile_steps)
    _check(span is None or span[0] <= cfg.train.steps, f"log.profile_steps = {cfg.log.profile_steps!r} starts after "
           f"the last step (train.steps = {cfg.train.steps}); choose steps within the run")
    _check(cfg.log.peak_tflops >= 0, f"log.peak_tflops = {cfg.log.peak_tflops}: must be >= 0 (0 = from the table)")
    import importlib.util

    for key, module, extra in (("wandb", "wandb", "wandb"), ("mlflow", "mlflow", "mlflow")):
        _check(not getattr(cfg.log, key) or importlib.util.find_spec(module) is not None,
               f"log.{key} = true but the {module} package is not installed; pip install 'disttrain[{extra}]' "
               f"or set log.{key} = false")


def _validate_run(cfg: Config) -> None:
    name = cfg.run.name
    _check(bool(name) and "/" not in name and name not in (".", ".."),
           f"run.name = {name!r}: must be a non-empty folder name without '/'; e.g. run.name = \"exp1\"")
    _check(bool(cfg.run.out_dir), "run.out_dir is empty; set it to a folder, e.g. run.out_dir = \"runs\"")


def validate_model(cfg: Config) -> None:
    """The model section alone (`deepspeed-config` writes a plan for any strategy)."""
    m = cfg.model
    if m.name != "gpt":
        module, _, factory = m.name.partition(":")
        _check(bool(module) and bool(factory),
               f"model.name = {m.name!r}: use \"gpt\" or \"package.module:factory\"")
    for key in ("n_layer", "n_head", "d_model", "seq_len", "vocab_size"):
        value = getattr(m, key)
        _check(value > 0, f"model.{key} = {value}: must be > 0")
    _check(m.d_model % m.n_head == 0,
           f"model.d_model = {m.d_model} is not divisible by model.n_head = {m.n_head}; "
           f"choose n_head among the divisors of {m.d_model}")
    _check(0.0 <= m.dropout < 1.0, f"model.dropout = {m.dropout}: must be in [0, 1)")


def _validate_data(cfg: Config, world: int, split: str = "world size") -> None:
    d, m = cfg.data, cfg.model
    if d.source != "builtin":
        path = Path(d.source)
        _check(path.is_file(), f"data.source = {d.source!r}: file not found; give an existing text, "
               f".jsonl, .bin or .npy file, or \"builtin\"")
        _check(path.stat().st_size > 0, f"data.source = {d.source!r}: the file is empty; give a file with data")
    _validate_tokenizer(d)
    if not d.tokenizer and (d.source == "builtin" or not d.source.endswith(TOKEN_FILE_SUFFIXES)):
        _check(m.vocab_size >= 256, f"model.vocab_size = {m.vocab_size}: byte-level data needs >= 256; "
               "set model.vocab_size = 256")
    _check(d.micro_batch_size > 0, f"data.micro_batch_size = {d.micro_batch_size}: must be > 0")
    _check(d.global_batch_size > 0, f"data.global_batch_size = {d.global_batch_size}: must be > 0")
    per_step = d.micro_batch_size * world
    if d.global_batch_size % per_step:
        lower = max(per_step, d.global_batch_size // per_step * per_step)
        raise ConfigError(
            f"data.global_batch_size = {d.global_batch_size} is not divisible by data.micro_batch_size x "
            f"{split} = {d.micro_batch_size} x {world} = {per_step}; set data.global_batch_size to a "
            f"multiple of {per_step} (e.g. {lower} or {lower + per_step}) or change micro_batch_size")
    _check(0.0 < d.val_fraction < 1.0, f"data.val_fraction = {d.val_fraction}: must be in (0, 1)")
    _check(d.num_workers >= 0, f"data.num_workers = {d.num_workers}: must be >= 0 (0 = load in the training process)")
    _check(d.prefetch_factor >= 1, f"data.prefetch_factor = {d.prefetch_factor}: must be >= 1")


def _validate_tokenizer(d: DataConfig) -> None:
    """The tokenizer is a local folder and goes with a text or .jsonl source (its vocabulary is checked against
    model.vocab_size when it is loaded: that needs transformers)."""
    if d.source.endswith(".jsonl"):
        _check(bool(d.tokenizer), f"data.source = {d.source!r} is a .jsonl file but data.tokenizer is not set; "
               "set data.tokenizer to the local folder of a Hugging Face tokenizer (tokenizer.save_pretrained(DIR))")
    if not d.tokenizer:
        return
    if not Path(d.tokenizer).exists() and re.fullmatch(r"[\w.-]+(/[\w.-]+)?", d.tokenizer):
        raise ConfigError(f"data.tokenizer = {d.tokenizer!r} looks like a Hugging Face hub id, and disttrain never "
                          "downloads; save it once where there is network (AutoTokenizer.from_pretrained(ID)"
                          ".save_pretrained(DIR)) and set data.tokenizer to that local directory")
    _check(Path(d.tokenizer).is_dir(), f"data.tokenizer = {d.tokenizer!r} is not a local directory; give the folder "
           "of a Hugging Face tokenizer (tokenizer.save_pretrained(DIR))")
    _check(d.source != "builtin" and not d.source.endswith(TOKEN_FILE_SUFFIXES),
           f"data.tokenizer is set but data.source = {d.source!r} is not a text or .jsonl file; "
           "unset data.tokenizer or give a text / .jsonl source")
    _check(bool(d.text_field), "data.text_field is empty; set it to the key of the text in each .jsonl line")


def _validate_optim_train(cfg: Config) -> None:
    o, t = cfg.optim, cfg.train
    _check(o.lr > 0 and math.isfinite(o.lr), f"optim.lr = {o.lr}: must be a finite number > 0, e.g. 3e-4")
    _check(o.weight_decay >= 0, f"optim.weight_decay = {o.weight_decay}: must be >= 0")
    _check(o.warmup_steps >= 0, f"optim.warmup_steps = {o.warmup_steps}: must be >= 0")
    _check(0.0 <= o.min_lr_ratio <= 1.0, f"optim.min_lr_ratio = {o.min_lr_ratio}: must be in [0, 1]")
    _check(o.grad_clip >= 0, f"optim.grad_clip = {o.grad_clip}: must be >= 0 (0 disables clipping)")
    _check(t.steps > 0, f"train.steps = {t.steps}: must be > 0; e.g. --set train.steps=100")
    _check(t.eval_every >= 0, f"train.eval_every = {t.eval_every}: must be >= 0 (0 disables evaluation)")
    _check(t.eval_samples >= 0, f"train.eval_samples = {t.eval_samples}: must be >= 0 (0 = all)")
    _check(t.log_every >= 1, f"train.log_every = {t.log_every}: must be >= 1")
    _check(t.max_consecutive_skips >= 0, f"train.max_consecutive_skips = {t.max_consecutive_skips}: must be >= 0")
    _check(0 <= t.stop_at <= t.steps, f"train.stop_at = {t.stop_at}: must be between 0 and train.steps = {t.steps}")


def strategies_for(cfg: Config, world: int) -> list[str]:
    """Every registered strategy (installed) that can run `cfg` at `world` ranks, GPUs assumed: the rows of
    `estimate-memory` and the default of `disttrain verify`."""
    out = []
    for name in registry.names():
        trial = copy.deepcopy(cfg)
        trial.parallel.strategy = name
        try:
            validate(trial, gpu_count=world, world=world)
        except ConfigError:
            continue
        out.append(name)
    return out


def _validate_parallel(cfg: Config, world: int, layout: mesh.MeshLayout) -> None:
    """Generic checks driven by the strategy's spec (world size, its own settings, its package), then its own,
    then the model against the layout."""
    p = cfg.parallel
    spec = registry.resolve(p.strategy, world)
    _check(spec.runs_on(world),
           f"parallel.strategy = {spec.name!r} runs on at most {spec.max_world} process(es) but the world size is "
           f"{world}; use parallel.strategy = 'ddp' (or 'auto') or --nproc {spec.max_world}")
    _check(p.bucket_cap_mb > 0, f"parallel.bucket_cap_mb = {p.bucket_cap_mb}: must be > 0")
    _check(p.powersgd_rank >= 1, f"parallel.powersgd_rank = {p.powersgd_rank}: must be >= 1")
    registry.check_options(spec, p, ParallelConfig())
    if spec.check is not None:
        spec.check(cfg, layout.data)
    mesh.check_model_split(cfg, layout)
    _check(registry.available(spec), f"parallel.strategy = {spec.name!r} but the {spec.package} package is not "
           f"installed; pip install 'disttrain[{spec.package}]' or choose another strategy")


def _validate_checkpoint(cfg: Config) -> None:
    c = cfg.checkpoint
    _check(c.every >= 0, f"checkpoint.every = {c.every}: must be >= 0 (0 disables saving)")
    _check(c.keep_last >= 1, f"checkpoint.keep_last = {c.keep_last}: must be >= 1 (the newest is always kept)")
    _check(c.keep_best >= 0, f"checkpoint.keep_best = {c.keep_best}: must be >= 0")
    _check(c.arrival_timeout_s > 0, f"checkpoint.arrival_timeout_s = {c.arrival_timeout_s}: must be > 0 seconds")
    if c.resume not in ("auto", "never"):
        _check(Path(c.resume).is_dir(), f"checkpoint.resume = {c.resume!r}: no such checkpoint folder; give a "
               "step_<N> folder, or 'auto' / 'never'")


def ray_resources(text: str) -> dict[str, float]:
    """`dist.ray_resources` ("name=amount,name=amount") as a dict; a ConfigError names a malformed entry."""
    out = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, amount = item.partition("=")
        try:
            out[name.strip()] = float(amount)
        except ValueError:
            raise ConfigError(f"dist.ray_resources = {text!r}: {item!r} is not NAME=AMOUNT, e.g. "
                              "'accelerator_type_a100=1,rollout=0.5'") from None
        _check(bool(name.strip()) and out[name.strip()] >= 0,
               f"dist.ray_resources = {text!r}: {item!r} needs a name and an amount >= 0")
    return out


def _validate_dist(cfg: Config, gpu_count: int, world: int) -> None:
    dc = cfg.dist
    _check(dc.nproc >= 1, f"dist.nproc = {dc.nproc}: must be >= 1 (--nproc)")
    for key in ("timeout_s", "startup_timeout_s", "shutdown_grace_s"):
        _check(getattr(dc, key) > 0, f"dist.{key} = {getattr(dc, key)}: must be > 0 seconds")
    _check(dc.threads_per_rank >= 0, f"dist.threads_per_rank = {dc.threads_per_rank}: must be >= 0")
    _check(dc.flight_recorder >= 0, f"dist.flight_recorder = {dc.flight_recorder}: must be >= 0 (0 = off)")
    if dc.launcher == "ray":
        _check(dc.ray_cpus_per_worker >= 0 and dc.ray_gpus_per_worker >= 0,
               "dist.ray_cpus_per_worker and dist.ray_gpus_per_worker must be >= 0")
        ray_resources(dc.ray_resources)
        return  # the ranks' devices are on the cluster's nodes, not this one: Ray's placement checks them
    if dc.device == "cuda":
        _check(gpu_count > 0, "dist.device = 'cuda' but no CUDA GPU is visible; set dist.device = 'cpu'")
    cuda = uses_cuda(cfg, gpu_count)
    if cuda:
        _check(dc.nproc <= gpu_count,
               f"dist.nproc = {dc.nproc} but this node has {gpu_count} GPU(s); use --nproc {gpu_count} "
               "or fewer, or set dist.device = 'cpu'")
    _check(not (dc.backend == "nccl" and not cuda),
           "dist.backend = 'nccl' needs CUDA GPUs, and this run uses the CPU; set dist.backend = 'gloo' or 'auto'")
