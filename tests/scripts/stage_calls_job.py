"""Ranks of a pipeline with a tensor split: the Trainer's step of each variant given ("NAME:KEY=VALUE,KEY=VALUE"
over the small job below, whose sequences are 16 tokens), its functional collectives recorded
(bench/tensor_calls.recording) through one step after a first; each rank writes them to OUT/calls-RANK.json, per
variant: [part, collective, bytes, dtype] of each, in order; and the shape of what an evaluation's forward of 15
tokens returns there (the logits on the last stage's ranks, elsewhere nothing)."""

import json
import sys
from pathlib import Path

import torch

from disttrain.bench import loops, overhead, tensor_calls
from disttrain.config import load_config
from disttrain.runtime import exit_process, shutdown

out, variants = Path(sys.argv[1]), dict(v.split(":", 1) for v in sys.argv[2:])
small = ["model.seq_len=16", "data.global_batch_size=4", "data.micro_batch_size=2", "dist.threads_per_rank=1",
         "train.steps=100", "parallel.strategy=ddp"]
runtime, train, sampler = overhead.start_worker(load_config(None, small))
calls = {}
widths = {}
for name, settings in variants.items():
    backend, _, step = loops.disttrain_job(load_config(None, [*small, *settings.split(",")]), runtime, train, sampler)
    step(0)
    with tensor_calls.recording() as recorder:
        step(1)
    calls[name] = [[c.part, c.collective, c.nbytes, c.dtype] for c in recorder.calls]
    with torch.no_grad():  # an evaluation's forward of 15 tokens: the last stage's logits as wide as the tokens
        widths[name] = list(backend.prepared.module(torch.zeros(2, 15, dtype=torch.long)).shape)
(out / f"calls-{runtime.rank}.json").write_text(json.dumps({"calls": calls, "widths": widths}))
shutdown(runtime)
exit_process(0)
