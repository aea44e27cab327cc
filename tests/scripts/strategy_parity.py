"""Train the same small GPT job under several strategies in one process group (one launch, many runs).

    python strategy_parity.py OUT single
    disttrain launch --nproc 2 strategy_parity.py OUT ddp zero2 fsdp+ac hsdp:1 ...

A variant is `strategy[+ac][:hsdp_shard_size]`. Rank 0 writes OUT/<world>.json: {variant: {"losses": [...],
"eval": {...}}}.
"""

import json
import sys
from pathlib import Path

from disttrain import Trainer, load_config
from disttrain.runtime import exit_process, init_runtime, shutdown

JOB = ["model.n_layer=2", "model.d_model=64", "model.seq_len=32", "data.global_batch_size=16",
       "data.micro_batch_size=4", "train.steps=20", "train.eval_every=10", "train.eval_samples=33",
       "log.progress=false", "dist.threads_per_rank=1", "dist.timeout_s=120"]


def overrides(variant: str) -> list[str]:
    name, _, shard = variant.partition(":")
    strategy, _, ac = name.partition("+")
    out = [f"parallel.strategy={strategy}", f"parallel.activation_checkpointing={str(ac == 'ac').lower()}"]
    return out + ([f"parallel.hsdp_shard_size={shard}"] if shard else [])


def main() -> None:
    out, variants = Path(sys.argv[1]), sys.argv[2:]
    runtime = None
    results = {}
    for variant in variants:
        cfg = load_config(None, [*JOB, f"run.out_dir={out}", f"run.name={variant.replace(':', '_')}",
                                 *overrides(variant)])
        runtime = runtime or init_runtime(cfg.dist)
        result = Trainer(cfg, runtime=runtime).fit()
        results[variant] = {"losses": result.losses, "eval": result.eval_losses}
    if runtime.is_main_process():
        (out / f"{runtime.world_size}.json").write_text(json.dumps(results))
    shutdown(runtime)


if __name__ == "__main__":
    main()
    exit_process(0)
