"""Typed configuration: nested dataclasses, TOML loading, dotted overrides and pure validation.

Every field carries a docstring (the string literal under it); `describe()` reads them back, so the
README table and `--help` never drift from the code. Each component receives only its own section.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import hashlib
import inspect
import json
import math
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib


from disttrain.errors import ConfigError
from disttrain.parallel import mesh, registry
from disttrain.precision import PRECISIONS, canonical_precision

__all__ = ["Config", "ConfigError", "load_config", "validate"]


@dataclass
class RunConfig:
    name: str = "default"
    """Run name; the run directory is `<out_dir>/<name>`."""
    out_dir: str = "runs"
    """Folder that holds run directories."""
    seed: int = 0
    """Seed for model initialisation, data order and every RNG; same seed, same run."""


@dataclass
class ModelConfig:
    name: str = "gpt"
    """`"gpt"` (the reference model) or `"package.module:factory"`, called as `factory(model_config)`."""
    n_layer: int = 4
    """Transformer blocks of the reference GPT."""
    n_head: int = 4
    """Attention heads per block; must divide `d_model`."""
    d_model: int = 128
    """Width of the residual stream."""
    seq_len: int = 64
    """Tokens per training sequence (context length)."""
    vocab_size: int = 256
    """Vocabulary size; at least 256 for the byte-level built-in and text-file data."""
    dropout: float = 0.0
    """Dropout probability. Non-zero dropout draws per-rank random masks, so N-rank runs no longer
    match one process bit for bit."""
    freeze: str = ""
    """Parameters that do not train: comma-separated glob patterns over the model's parameter names (as
    `model.named_parameters()` gives them), e.g. `"tok_emb.*,blocks.0.*"` or, for a Hugging Face Llama,
    `"model.embed_tokens.*"`. `*` matches dots too: `"blocks.1*"` also matches blocks 10-19, `"blocks.1.*"` does
    not. A tied weight (an embedding shared with the head) is one parameter: either name freezes it. Frozen
    parameters get no gradient, no optimizer state, no gradient traffic; checkpoints still hold them. A pattern
    that matches nothing, or patterns that leave nothing to train, are refused."""


@dataclass
class DataConfig:
    source: str = "builtin"
    """`"builtin"` (an offline, learnable synthetic language), a UTF-8 text file (byte tokens, or tokenised with
    `data.tokenizer`), a `.jsonl` file of documents (needs `data.tokenizer`), or a pre-tokenised `.bin` / `.npy`
    token file (memory-mapped)."""
    tokenizer: str = ""
    """Local folder of a Hugging Face tokenizer (`tokenizer.save_pretrained(DIR)`; never downloaded) that tokenises
    a text or `.jsonl` source: each document once, EOS after each, packed into one token stream, cached next to the
    source as `<source>.<hash>.tokens.npy`. In a text file, documents are separated by blank lines. Empty = byte
    tokens for a text file."""
    text_field: str = "text"
    """Key of the document text in each line of a `.jsonl` source."""
    global_batch_size: int = 32
    """Sequences per optimizer step, summed over all ranks and accumulation micro-batches."""
    micro_batch_size: int = 8
    """Sequences per rank per forward pass; accumulation steps = global / (micro x world size)."""
    token_dtype: str = "uint16"
    """Element type of a raw `.bin` token file: `uint16`, `uint32` or `int32`."""
    val_fraction: float = 0.1
    """Fraction of the tokens (taken from the end) held out for evaluation."""
    shuffle: bool = True
    """Shuffle sample order each epoch (a pure function of seed and epoch)."""
    num_workers: int = 0
    """DataLoader worker processes per rank that read and collate batches ahead of the step; 0 = in the training
    process. The batches, and so the run, are the same for any value."""
    prefetch_factor: int = 2
    """Batches each worker loads ahead (used when `num_workers > 0`)."""
    persistent_workers: bool = False
    """Keep the evaluation loader's workers alive between evaluations (used when `num_workers > 0`; the training
    loader runs once per run). Memory is pinned automatically on CUDA."""


@dataclass
class OptimConfig:
    name: str = "adamw"
    """Optimizer: `adamw` or `sgd`."""
    lr: float = 2e-3
    """Peak learning rate, reached after warmup."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices only (not to biases, norms or embeddings' bias)."""
    beta1: float = 0.9
    """AdamW beta1 (momentum for `sgd`)."""
    beta2: float = 0.95
    """AdamW beta2."""
    schedule: str = "auto"
    """Learning-rate schedule: `cosine` (linear warmup over `warmup_steps`, then cosine decay to `min_lr_ratio` x the
    peak at `train.steps`), `constant` (warmup, then the peak), `none` (the optimizer's own learning rate, untouched),
    or `auto`: `cosine` for disttrain's optimizer, `none` when you pass your own optimizer factory."""
    warmup_steps: int = 10
    """Linear warmup steps from 0 to `lr` (`cosine` and `constant` schedules)."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of `lr` at the end of the cosine decay."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""


@dataclass
class TrainConfig:
    steps: int = 100
    """Optimizer steps to train."""
    eval_every: int = 50
    """Evaluate every N steps and at the end; 0 disables evaluation."""
    eval_samples: int = 256
    """Validation sequences per evaluation (0 = the whole validation set); each counted exactly once."""
    log_every: int = 10
    """Write a `metrics.jsonl` line and refresh the progress bar every N steps (and at an evaluation, a stop and the
    last step). Each line gathers every rank's step time, peak memory and exposed communication (one small
    all-gather, about 1.5% of a 2-rank CPU step here when every step is logged); torchtitan and DeepSpeed log every
    10 steps too."""
    on_nonfinite: str = "stop"
    """fp32/bf16: a non-finite loss or gradient `stop`s the run (naming step and rank) before the optimizer
    touches the parameters, or the step is `skip`ped and counted. (fp16 always skips, via loss scaling.)"""
    max_consecutive_skips: int = 25
    """Stop the run, explaining why, after this many skipped optimizer steps in a row."""
    stop_at: int = 0
    """End this run after step N (0 = at `steps`), saving a checkpoint there when `checkpoint.every > 0`;
    the schedule still spans `steps`, so running again resumes exactly where this run stopped."""


@dataclass
class ParallelConfig:
    strategy: str = "auto"
    """`auto` (`single` on one process, `ddp` on more) or a registered strategy:"""
    precision: str = "fp32"
    """`fp32`, `bf16-mixed`, `fp16-mixed` (with dynamic loss scaling) or `bf16-true` (see precision.py). The
    spellings of Lightning Fabric and Accelerate are accepted and turned into these names when the config is
    read: `bf16` -> `bf16-mixed`; `16`, `16-mixed`, `fp16` -> `fp16-mixed`; `32`, `32-true`, `no` -> `fp32`
    (float16 weights, Fabric's `16-true`, have no equivalent here)."""
    bucket_cap_mb: float = 25.0
    """DDP gradient bucket size in MiB."""
    gradient_as_bucket_view: bool = True
    """DDP: gradients are views into the communication buckets (saves one gradient copy, in steps of one
    micro-batch: a step that accumulates holds the earlier micro-batches' gradients beside the buckets, since each
    step clears the gradients to None)."""
    static_graph: bool = False
    """DDP: the set of used parameters never changes between iterations (enables optimisations). Only with one
    micro-batch per step: torch's DDP cannot accumulate (no_sync) with a static graph (pytorch/pytorch#143580)."""
    find_unused_parameters: bool = False
    """DDP: tolerate parameters that receive no gradient in a step (slower; needed for branching models)."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in backward (less memory, ~1/3 more compute)."""
    reshard_after_forward: bool = True
    """fsdp/zero3/hsdp: free gathered parameters after each block's forward (gather again in backward). Not under
    a pipeline schedule that splits the backward (zero-bubble, zbv, dualpipev): there the weight part needs the
    gathered parameters the forward used."""
    hsdp_shard_size: int = 0
    """hsdp: ranks per sharding group (replicated across groups); 0 = all ranks (plain FSDP). On several nodes,
    the data-parallel ranks of one node (e.g. 8): shard within a node, replicate across (rank 0 warns otherwise)."""
    fsdp_prefetch: int = 0
    """zero2/fsdp/zero3/hsdp: all-gather the next N transformer blocks' parameters while the current block runs
    (forward and backward; FSDP2 explicit prefetching). 0 = FSDP2's default (one block, implicitly)."""
    grad_compression: str = "none"
    """Compress gradient communication: `none`, `fp16` or `bf16` (gradients cross the wire in that dtype: DDP's
    compression hooks, the FSDP strategies' reduce dtype; half the bytes) or `powersgd` (DDP only: low-rank PowerSGD
    with error feedback, rank `powersgd_rank`; on gloo it runs with one gradient bucket). The numbers change
    slightly (see docs/benchmarks/scaling.md for the eval-loss cost); PowerSGD's error-feedback state is not
    checkpointed, so a resumed run restarts it."""
    powersgd_rank: int = 1
    """`grad_compression = "powersgd"`: rank of the low-rank approximation (higher: more bytes, closer to exact)."""
    cpu_offload: bool = False
    """Keep parameters and optimizer state in host memory: FSDP2 CPUOffloadPolicy for the FSDP strategies,
    ZeRO-Offload for `deepspeed` (`offload_optimizer` to cpu at stages 1-3, and `offload_param` too at stage 3).
    Saves GPU memory; on a CPU-only run it changes nothing but the code path (useful for testing it)."""
    tensor: int = 1
    """Tensor-parallel degree: each transformer block's attention and MLP matrices are split across this many
    ranks (DTensor `parallelize_module`, column-wise then row-wise, Megatron style); 1 = not split. The world size
    is parallel.pipeline x parallel.tensor x the data-parallel degree (parallel/mesh.py)."""
    context: int = 1
    """Context-parallel degree: each sequence is cut into this many consecutive chunks, one per rank, and each
    attention gathers the keys and values of the whole sequence from the others (parallel/context.py); for
    sequences too long for one device's activations. 1 = not split. The reference GPT and Hugging Face models
    (through transformers' attention interface), with a data-parallel strategy (the gradients are reduced over
    data x context ranks); not yet with parallel.pipeline or parallel.tensor. Causal attention without a padding
    mask: pad on the right."""
    sequence_parallel: bool = False
    """parallel.tensor > 1: also split the layer norms' and dropouts' activations along the sequence across the
    tensor-parallel ranks (less activation memory; the same numbers)."""
    loss_parallel: str = "auto"
    """parallel.tensor > 1 (without a pipeline): `true` runs disttrain's own cross-entropy on the head's logits as
    they come, split by vocabulary across the tensor-parallel ranks (torch's `loss_parallel`), so no rank gathers or
    keeps the micro-batch x seq_len x vocabulary logits for training (a `loss_fn` of your own, evaluation and
    `forward()` still get them whole); `false` always gathers them; `auto` splits them for vocabularies of 8192
    tokens and more, where the logits are the largest activation (on a toy vocabulary the split loss's fixed cost
    per micro-batch is more than the gather it saves). The same numbers either way."""
    pipeline: int = 1
    """Pipeline stages: the model's blocks are split into this many consecutive stages, one per rank of a
    pipeline group (`torch.distributed.pipelining`); 1 = not split."""
    pipeline_schedule: str = "1f1b"
    """parallel.pipeline > 1: `gpipe`, `1f1b`, `interleaved-1f1b` (two virtual stages per rank), `zero-bubble`
    (torch's interleaved zero-bubble schedule, two virtual stages per rank) or `zbv` (torch's V-shaped zero-bubble
    schedule: rank r runs stages r and 2p - 1 - r, so the first and last stage share rank 0) or `dualpipev` (torch's
    DualPipeV, the same V; at least 2p micro-batches per step). Under the split-backward ones (zero-bubble, zbv,
    dualpipev) FSDP keeps a stage's parameters unsharded from forward to backward (as zero2)."""
    pipeline_microbatches: int = 0
    """Micro-batches per step through the pipeline; 0 = what the batch settings give (data.global_batch_size /
    (data-parallel degree x data.micro_batch_size)); a value that disagrees with them is an error naming the
    micro-batch size that would give it."""
    pipeline_split: str = ""
    """parallel.pipeline > 1: the module names where stages 2, 3, ... begin, comma-separated (e.g. "blocks.3");
    empty = balanced by parameter count, embeddings on the first stage and the head on the last."""
    deepspeed_stage: int = 2
    """deepspeed: ZeRO stage 0 (data parallel), 1 (optimizer state sharded), 2 (+ gradients) or 3 (+ parameters)."""
    deepspeed_config: str = ""
    """deepspeed: path of a DeepSpeed JSON whose other settings (bucket sizes, overlap_comm, stage-3 tuning, ...)
    are used as they are; disttrain sets the batch, clipping, stage and offload keys (a disagreeing value is an
    error). `disttrain deepspeed-config` writes a starting point."""


@dataclass
class CheckpointConfig:
    every: int = 0
    """Save a checkpoint every N steps; 0 disables saving."""
    keep_last: int = 3
    """Keep the newest N committed checkpoints."""
    keep_best: int = 1
    """Also keep the best K checkpoints by `best_metric` (and one saved with `is_best=True`): rotation never deletes
    the best checkpoint unless this is 0."""
    best_metric: str = "eval_loss"
    """Metric that ranks checkpoints for `keep_best` (a checkpoint without it, or with NaN, is never best)."""
    best_mode: str = "min"
    """`min` or `max`: whether a smaller or a larger `best_metric` is better."""
    async_save: bool = False
    """Write checkpoints in the background while training continues (at most one save in flight)."""
    on_error: str = "abort"
    """When a save fails (disk full, I/O error): `abort` the run, or `continue` training with a warning."""
    resume: str = "auto"
    """`auto` (newest committed checkpoint of this run, if any), `never`, or the path of a checkpoint folder."""
    arrival_timeout_s: float = 60.0
    """Saving and loading are collective: a rank that waits this long for the others (e.g. the manager called under
    `if rank == 0`) stops with a message naming the missing ranks instead of hanging."""


@dataclass
class DistConfig:
    nproc: int = 1
    """Processes on this node (`--nproc`); 1 runs in the current process without torchrun."""
    backend: str = "auto"
    """Process-group backend: `auto` (nccl on CUDA, gloo on CPU), `nccl` or `gloo`."""
    device: str = "auto"
    """`auto` (cuda:LOCAL_RANK when a GPU is present, else cpu), `cpu` or `cuda`."""
    timeout_s: float = 300.0
    """Watchdog limit in seconds: a rank that makes no progress for this long (after the first step) ends the
    job, and the summary names it, instead of a silent hang. Collectives time out later, after
    `timeout_s + startup_timeout_s` (a backstop when no disttrain launcher watches, e.g. plain torchrun)."""
    startup_timeout_s: float = 900.0
    """The same limit until the first step completes (start-up, data loading, compilation are slower)."""
    shutdown_grace_s: float = 60.0
    """After SIGTERM/SIGINT, ranks finish their step and checkpoint within this many seconds, then exit (a
    signal that arrives during a step's last backward is acted on after the next step: allow for two steps)."""
    threads_per_rank: int = 0
    """torch intra-op threads per rank; 0 = cores / processes on this node (at least 1)."""
    flight_recorder: int = 2000
    """Collectives each rank keeps a record of (torch's flight recorder: `TORCH_FR_BUFFER_SIZE`, unless set): when the
    watchdog stops a hung job, the summary says which collective each rank waits in and which rank never reached
    it (every record: `RUN_DIR/status/rank<R>.collectives.json`). 0 = off."""
    launcher: str = "torchrun"
    """How `disttrain train --nproc N` starts its ranks: `torchrun` (this node's processes) or `ray` (Ray actors in
    a placement group, on any node of a Ray cluster; `pip install 'disttrain[ray]'`)."""
    ray_address: str = ""
    """`launcher = "ray"`: the cluster to join (`auto`, `ray://HOST:PORT`, HOST:PORT); empty = RAY_ADDRESS, a cluster
    `ray start` left on this machine, or a new local one."""
    ray_cpus_per_worker: float = 1.0
    """`launcher = "ray"`: CPUs reserved for each rank."""
    ray_gpus_per_worker: float = 0.0
    """`launcher = "ray"`: GPUs for each rank (1 for nccl: a rank needs a device of its own)."""
    ray_resources: str = ""
    """`launcher = "ray"`: custom resources for each rank, `name=amount,name=amount`."""
    ray_placement: str = "PACK"
    """`launcher = "ray"`: placement-group strategy: PACK, SPREAD, STRICT_PACK or STRICT_SPREAD."""


@dataclass
class LogConfig:
    progress: bool = True
    """Show a progress bar with loss and tokens/s on rank 0."""
    tensorboard: bool = False
    """Also write TensorBoard event files to `RUN_DIR/tensorboard` (needs `pip install tensorboard`)."""
    peak_tflops: float = 0.0
    """Peak TFLOP/s of one device for `mfu` (model FLOPs utilisation); 0 = from the table of known accelerators
    (H100, H200, A100, ...; `mfu` is null on a CPU or an unknown device)."""
    wandb: bool = False
    """Also log to Weights & Biases (`pip install 'disttrain[wandb]'`; `WANDB_MODE=offline` logs to files only)."""
    wandb_project: str = "disttrain"
    """The Weights & Biases project (the run is named after `run.name`)."""
    mlflow: bool = False
    """Also log to MLflow (`pip install 'disttrain[mlflow]'`)."""
    mlflow_uri: str = ""
    """MLflow tracking URI; empty = a local file store in RUN_DIR/mlruns."""
    profile_steps: str = ""
    """Write a torch.profiler trace of these steps, e.g. `"10-12"` or `"5"`, to `RUN_DIR/profile/rank<R>.json`
    (one per rank; open in Perfetto or chrome://tracing). On CUDA also `rank<R>_comm.json`: the collectives' device
    time per step and the part no other kernel overlapped (exposed). Empty = no profiling."""


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    log: LogConfig = field(default_factory=LogConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.out_dir) / self.run.name

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def hash(self) -> str:
        """Stable digest of the resolved configuration (used to check that ranks agree)."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


SECTIONS: dict[str, type] = {f.name: f.type for f in dataclasses.fields(Config)}
SECTIONS = {name: globals()[typ] if isinstance(typ, str) else typ for name, typ in SECTIONS.items()}

# Values accepted by choice-valued settings; strategies and precisions come from their registries,
# which are imported lazily by `validate` so that loading a config never imports torch.
CHOICES: dict[str, tuple[str, ...]] = {
    "data.token_dtype": ("uint16", "uint32", "int32"),
    "optim.name": ("adamw", "sgd"),
    "optim.schedule": ("auto", "cosine", "constant", "none"),
    "dist.backend": ("auto", "nccl", "gloo"),
    "dist.device": ("auto", "cpu", "cuda"),
    "dist.launcher": ("torchrun", "ray"),
    "dist.ray_placement": ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"),
    "checkpoint.best_mode": ("min", "max"),
    "checkpoint.on_error": ("abort", "continue"),
    "train.on_nonfinite": ("stop", "skip"),
    "parallel.grad_compression": ("none", "fp16", "bf16", "powersgd"),
    "parallel.pipeline_schedule": ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv", "dualpipev"),
    "parallel.loss_parallel": ("auto", "true", "false"),
}


# ----------------------------------------------------------------------------------------------
# Loading and overriding


def _suggest(word: str, options: list[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.5)
    return f"did you mean '{close[0]}'?" if close else f"valid names: {', '.join(options)}"


def _coerce(key: str, value: Any, typ: type) -> Any:
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif typ is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        if isinstance(value, bool) and "true" in CHOICES.get(key, ()):  # auto | true | false settings
            return str(value).lower()
    raise ConfigError(f"{key} = {value!r}: expected {typ.__name__}; fix the value in the config or --set")


def _field_types(section_cls: type) -> dict[str, type]:
    hints = inspect.get_annotations(section_cls, eval_str=True)
    return {f.name: hints[f.name] for f in dataclasses.fields(section_cls)}


def set_value(cfg: Config, dotted: str, value: Any) -> None:
    """Set `section.key` on `cfg`, checking the names and coercing the value to the field's type; an
    accepted alias (e.g. a precision's) becomes its canonical name here."""
    section, _, key = dotted.partition(".")
    if section not in SECTIONS or not key:
        raise ConfigError(f"unknown setting '{dotted}': {_suggest(section, list(SECTIONS))}")
    types = _field_types(SECTIONS[section])
    if key not in types:
        names = list(types)
        raise ConfigError(f"unknown setting '{dotted}': {_suggest(key, names)} (section [{section}])")
    value = _coerce(dotted, value, types[key])
    if dotted == "parallel.strategy":
        value = registry.canonical(value)  # documented aliases (zero3 -> fsdp) become the one name here
    if dotted == "parallel.precision":
        value = canonical_precision(value)  # Fabric's and Accelerate's spellings become the one name here
    setattr(getattr(cfg, section), key, value)


def _parse_override(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.key=value, e.g. --set optim.lr=1e-3")
    key, raw = (part.strip() for part in text.split("=", 1))
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # bare words are strings: --set model.name=gpt
    return key, value


GPU_BOUND_ENV = "DISTTRAIN_GPU_BOUND"
"""Set to 1 by the Ray launchers for an actor Ray gave GPUs of its own (it sees only those): the rank is bound to
GPU 0 of what it sees, whatever its local rank (runtime.pick_device)."""
NODE_CLAIM_ENV = "DISTTRAIN_NODE_CLAIM"
"""Set by disttrain's launcher for its workers on a multi-node job: `NODE_RANK@RDZV_ENDPOINT`, the --node-rank this
node was given (runtime.py checks that no two nodes were given the same one)."""

ENV_PREFIX = "DISTTRAIN_DIST_"
"""`dist.<key>` from the environment: DISTTRAIN_DIST_NPROC=2, DISTTRAIN_DIST_BACKEND=gloo, ..."""


def to_env(dist: DistConfig) -> dict[str, str]:
    """The dist section as environment variables (`from_env` reads them back): for a subprocess or a job script."""
    values = {f.name: getattr(dist, f.name) for f in dataclasses.fields(dist)}
    return {ENV_PREFIX + k.upper(): v if isinstance(v, str) else _toml_value(v) for k, v in values.items()}


def from_env(environ: Mapping[str, str] | None = None, dist: DistConfig | None = None) -> DistConfig:
    """`dist` (default: the defaults) with every DISTTRAIN_DIST_* variable of `environ` applied; an unknown name
    or a value of the wrong type is a one-line ConfigError."""
    cfg = Config(dist=dist or DistConfig())
    environ = os.environ if environ is None else environ
    for name in sorted(k for k in environ if k.startswith(ENV_PREFIX)):
        key = name[len(ENV_PREFIX):].lower()
        if key not in _field_types(DistConfig):
            raise ConfigError(f"environment variable {name}: no setting dist.{key}; "
                              f"{_suggest(key, list(_field_types(DistConfig)))} (or unset it)")
        try:
            set_value(cfg, f"dist.{key}", _parse_override(f"dist.{key}={environ[name]}")[1])
        except ConfigError as exc:
            raise ConfigError(f"environment variable {name}={environ[name]!r}: {str(exc).split(': ', 1)[-1]}; "
                              "fix or unset it") from None
    return cfg.dist


def _read_file(path: Path) -> dict[str, Any]:
    """A config file's sections as a dict: TOML, YAML (.yaml/.yml, needs PyYAML) or JSON, by its suffix."""
    suffix = path.suffix.lower()
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigError(f"config file '{path}': cannot read it ({reason}); give a TOML, YAML or JSON file") from None
    if suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ConfigError(f"config file '{path}' is YAML, which needs PyYAML: pip install 'disttrain[yaml]' "
                              "(or write it as TOML or JSON)") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ConfigError(f"config file '{path}' is not valid YAML ({where}{problem}); fix the syntax") from None
        kind = "YAML"
    elif suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config file '{path}' is not valid JSON ({exc}); fix the syntax") from None
        kind = "JSON"
    else:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file '{path}' is not valid TOML ({exc}); fix the syntax") from None
        kind = "TOML"
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}': the top level of the {kind} must be a mapping of sections "
                          "(run:, model:, ...), not a list or a value")
    return data


def load_config(path: str | os.PathLike | None = None, overrides: list[str] = (),
                environ: Mapping[str, str] | None = None) -> Config:
    """Defaults, then the config file (TOML, YAML or JSON, if any), then DISTTRAIN_DIST_* environment variables
    (`from_env`), then `--set section.key=value` overrides: `--set` > environment > file > defaults."""
    cfg = Config()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file '{path}' does not exist; pass an existing TOML, YAML or JSON file")
        for section, values in _read_file(path).items():
            if not isinstance(values, dict):
                raise ConfigError(
                    f"'{section}' in {path}: settings belong in sections, e.g. [{section}]; "
                    f"{_suggest(section, list(SECTIONS))}"
                )
            for key, value in values.items():
                set_value(cfg, f"{section}.{key}", value)
    cfg.dist = from_env(environ, cfg.dist)
    for text in overrides:
        set_value(cfg, *_parse_override(text))
    return cfg


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ("nan" if math.isnan(value) else
                                                         ("inf" if value > 0 else "-inf"))
    if isinstance(value, int):
        return str(value)
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


def dumps_toml(cfg: Config) -> str:
    lines = []
    for section, values in cfg.to_dict().items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in values.items()]
        lines.append("")
    return "\n".join(lines)


def save_config(cfg: Config, path: str | os.PathLike) -> None:
    """Write the fully resolved config atomically (temp file + rename). The temp file is this process's own: the
    nodes of a multi-node job may write the same run folder (shared storage, or one machine) at the same moment."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(dumps_toml(cfg))
    os.replace(tmp, path)


def describe() -> list[tuple[str, str, Any, str]]:
    """(dotted key, type, default, docstring) for every setting, read from the source docstrings; the strategy
    names, and which strategies read each strategy-specific setting, come from the strategy registry."""
    users = registry.option_users()
    rows = []
    for section, cls in SECTIONS.items():
        docs = _field_docstrings(cls)
        defaults = cls()
        for name, typ in _field_types(cls).items():
            doc = docs.get(name, "")
            if section == "parallel" and name == "strategy":
                doc += " " + "; ".join(f"`{spec.name}`: {spec.summary}" + (
                    f" (alias {', '.join(spec.aliases)})" if spec.aliases else "") + (
                    f" (`pip install 'disttrain[{spec.package}]'`)" if spec.package else "")
                    for spec in map(registry.get, registry.names())) + "."
            elif section == "parallel" and name in users:
                doc += f" Read by: {', '.join(users[name])}."
            rows.append((f"{section}.{name}", typ.__name__, getattr(defaults, name), doc))
    return rows


def _field_docstrings(cls: type) -> dict[str, str]:
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


# ----------------------------------------------------------------------------------------------
# Validation: pure checks on the values (plus whether named files exist), before any process starts.

TOKEN_FILE_SUFFIXES = (".bin", ".npy")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _check_choice(key: str, value: str, options: tuple[str, ...] | list[str]) -> None:
    if value not in options:
        raise ConfigError(f"{key} = {value!r} is not known; {_suggest(value, list(options))}")


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
