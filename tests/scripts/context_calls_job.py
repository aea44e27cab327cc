"""Ranks of a context split: the Trainer's step of each variant given ("NAME:KEY=VALUE,KEY=VALUE" over the small
job below: sequences of 16 tokens, 2 micro-batches of 2 a step), the context split's collectives recorded
(bench/tensor_calls.recording with the process group's calls) through one step after a first; each rank writes them
to OUT/calls-RANK.json, per variant: [part, collective, bytes, dtype] of each, in order."""

import json
import sys
from pathlib import Path

from disttrain.bench import loops, overhead, tensor_calls
from disttrain.config import load_config
from disttrain.runtime import exit_process, shutdown

out, variants = Path(sys.argv[1]), dict(v.split(":", 1) for v in sys.argv[2:])
small = ["model.seq_len=16", "data.global_batch_size=4", "data.micro_batch_size=2", "dist.threads_per_rank=1",
         "train.steps=100", "train.log_every=1000", "parallel.strategy=ddp", "parallel.context=2"]
runtime, train, sampler = overhead.start_worker(load_config(None, small))
calls = {}
for name, settings in variants.items():
    _, _, step = loops.disttrain_job(load_config(None, [*small, *settings.split(",")]), runtime, train, sampler)
    step(0)
    with tensor_calls.recording(process_group_calls=True) as recorder:
        step(1)
    calls[name] = [[c.part, c.collective, c.nbytes, c.dtype] for c in recorder.calls]
(out / f"calls-{runtime.rank}.json").write_text(json.dumps(calls))
shutdown(runtime)
exit_process(0)
