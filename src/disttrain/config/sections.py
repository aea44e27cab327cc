"""The configuration's sections: nested dataclasses, a docstring under every field (`describe()` reads them back, so
the README table, `config --list` and docs/config.md never drift from the code), and the values each choice-valued
setting accepts."""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


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
    compile: str = ""
    """Compile each transformer block with `torch.compile`, in place (names and checkpoints unchanged), under the
    strategies, pipelines and context splits (not a tensor split, DeepSpeed's ZeRO-3 or a checkpointed context
    split): `""` off, `"inductor"` (fused kernels: Triton on a
    GPU, C++ on a CPU, which needs a C compiler), `"aot_eager"` (traced, not fused: checks that the model compiles)
    or another of `torch._dynamo.list_backends()`. The first step compiles (seconds to minutes, within
    `dist.startup_timeout_s`), the first evaluation and a new shape again (within `dist.timeout_s`)."""
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
    """Context-parallel degree N: each sequence in 2N pieces, rank r taking r and 2N - 1 - r (balanced causal
    attention), each attention gathering the whole sequence's keys and values (parallel/context.py); for long
    sequences. 1 = not split. The reference GPT and Hugging Face models, with a data-parallel strategy (gradients
    reduced over data x context ranks), and parallel.tensor or parallel.pipeline. Causal: pad on the right."""
    sequence_parallel: bool = False
    """parallel.tensor > 1: also split the layer norms' and dropouts' activations along the sequence across the
    tensor-parallel ranks (less activation memory; the same numbers)."""
    loss_parallel: str = "auto"
    """parallel.tensor > 1 (without a pipeline): `true` runs disttrain's own cross-entropy on the head's logits split
    by vocabulary across the tensor-parallel ranks (torch's `loss_parallel`): no rank gathers or keeps the whole
    logits for training (a `loss_fn` of your own, evaluation and `forward()` still get them whole); `false` always
    gathers them; `auto` splits them for vocabularies of 8192 tokens and more (on a toy vocabulary the split loss's
    fixed cost per micro-batch is more than the gather it saves). The same numbers either way."""
    pipeline: int = 1
    """Pipeline stages: the model's blocks are split into this many consecutive stages, one per rank of a
    pipeline group (`torch.distributed.pipelining`); 1 = not split."""
    pipeline_schedule: str = "1f1b"
    """parallel.pipeline > 1: `gpipe`, `1f1b`, `interleaved-1f1b` or `zero-bubble` (torch's interleaved zero-bubble;
    both loop over virtual stages, 2 per rank unless parallel.pipeline_stages_per_rank says), `zbv` (torch's
    V-shaped zero-bubble: rank r runs stages r and 2p - 1 - r, the first and last on rank 0) or `dualpipev` (the
    same V; at least 2p micro-batches per step). Under the split-backward ones (zero-bubble, zbv, dualpipev) FSDP
    keeps a stage's parameters unsharded from forward to backward (as zero2)."""
    pipeline_stages_per_rank: int = 0
    """parallel.pipeline > 1: stages each pipeline rank runs; 0 = the schedule's (1 for gpipe and 1f1b, else 2).
    interleaved-1f1b and zero-bubble take 2 or more: v a rank cut the bubble to (p - 1) / (v m) of a step of m
    micro-batches, for 2 (p v - 1) sends; the blocks must fill p x v stages (126 over 16 ranks: up to 7)."""
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


SECTIONS: dict[str, type] = {f.name: globals()[f.type] if isinstance(f.type, str) else f.type
                              for f in dataclasses.fields(Config)}


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


def suggest(word: str, options: list[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.5)
    return f"did you mean '{close[0]}'?" if close else f"valid names: {', '.join(options)}"


def field_types(section_cls: type) -> dict[str, type]:
    hints = inspect.get_annotations(section_cls, eval_str=True)
    return {f.name: hints[f.name] for f in dataclasses.fields(section_cls)}
