"""Train the same small GPT job under several strategies in one process group (one launch, many runs).

    python strategy_parity.py OUT single
    disttrain launch --nproc 2 strategy_parity.py OUT ddp zero2 fsdp+ac hsdp:1 deepspeed+stage3 ...

A variant is `strategy[+flag...][:hsdp_shard_size]`, flags: `ac` (activation checkpointing), `offload`
(cpu_offload), `prefetchN` (fsdp_prefetch=N), `stageN` (deepspeed_stage=N), `bf16` (bf16-mixed), `fp16` (fp16-mixed).
`A>B` trains A to step 10 with a checkpoint there, then resumes it under B to step 20 (its losses are
steps 11-20). Rank 0 writes OUT/<world>.json: {variant: {"losses": [...], "eval": {...}}}.
"""

import json
import sys
from pathlib import Path

from disttrain import Trainer, load_config
from disttrain.runtime import exit_process, init_runtime, shutdown

JOB = ["model.n_layer=2", "model.d_model=64", "model.seq_len=32", "data.global_batch_size=16",
       "data.micro_batch_size=4", "train.steps=20", "train.eval_every=10", "train.eval_samples=33",
       "log.progress=false", "dist.threads_per_rank=1", "dist.timeout_s=120"]


FLAGS = {"ac": "parallel.activation_checkpointing=true", "offload": "parallel.cpu_offload=true",
         "prefetch": "parallel.fsdp_prefetch={}", "stage": "parallel.deepspeed_stage={}",
         "bf": "parallel.precision=bf{}-mixed", "fp": "parallel.precision=fp{}-mixed"}


def overrides(variant: str) -> list[str]:
    name, _, shard = variant.partition(":")
    strategy, *flags = name.split("+")
    out = [f"parallel.strategy={strategy}"]
    for flag in flags:
        key = flag.rstrip("0123456789")
        out.append(FLAGS[key].format(flag[len(key):]))
    return out + ([f"parallel.hsdp_shard_size={shard}"] if shard else [])


def train(out: Path, runtime, name: str, variant: str, extra: list[str]):
    cfg = load_config(None, [*JOB, f"run.out_dir={out}", f"run.name={name}", *overrides(variant), *extra])
    return Trainer(cfg, runtime=runtime).fit()


def main() -> None:
    out, variants = Path(sys.argv[1]), sys.argv[2:]
    runtime = init_runtime(load_config(None, JOB).dist)
    results = {}
    for variant in variants:
        first, _, then = variant.partition(">")
        name = variant.replace(":", "_").replace(">", "_to_")
        if then:  # the second run resumes the first's checkpoint (same run dir, checkpoint.resume = auto)
            train(out, runtime, name, first, ["checkpoint.every=10", "train.stop_at=10"])
            result = train(out, runtime, name, then, ["checkpoint.every=10"])
        else:
            result = train(out, runtime, name, variant, [])
        results[variant] = {"losses": result.losses, "eval": result.eval_losses}
    if runtime.is_main_process():
        (out / f"{runtime.world_size}.json").write_text(json.dumps(results))
    shutdown(runtime)


if __name__ == "__main__":
    main()
    exit_process(0)
