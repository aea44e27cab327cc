"""Two ranks: the Trainer's step of a tensor-parallel GPT (parallel.tensor = 2) under each variant given, its
functional collectives recorded (bench/tensor_calls.recording) through one step; rank 0 writes them to
OUT/calls.json, per variant: [part, collective, bytes, dtype] of each, in order."""

import json
import sys
from pathlib import Path

from disttrain.bench import loops, overhead, tensor_calls
from disttrain.config import load_config
from disttrain.runtime import exit_process, shutdown

out, variants = Path(sys.argv[1]), sys.argv[2:]
small = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.seq_len=16", "data.global_batch_size=4",
         "data.micro_batch_size=2", "dist.threads_per_rank=1", "train.steps=100", "parallel.strategy=ddp",
         "parallel.tensor=2"]
VARIANTS = {"plain": [], "sp": ["parallel.sequence_parallel=true"],
            "bf16+lp": ["parallel.precision=bf16-mixed", "parallel.loss_parallel=true"],
            "ac+sp": ["parallel.activation_checkpointing=true", "parallel.sequence_parallel=true"]}
runtime, train, sampler = overhead.start_worker(load_config(None, small))
calls = {}
for variant in variants:
    step = loops.disttrain_loop(load_config(None, [*small, *VARIANTS[variant]]), runtime, train, sampler)
    step(0)
    with tensor_calls.recording() as recorder:
        step(1)
    calls[variant] = [[c.part, c.collective, c.nbytes, c.dtype] for c in recorder.calls]
if runtime.rank == 0:
    (out / "calls.json").write_text(json.dumps(calls))
shutdown(runtime)
exit_process(0)
