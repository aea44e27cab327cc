"""The in-run figures' checks that need real ranks, in one process group (start-up shared):

- two 200-step runs: the default loop, and the same loop with a loss function that leaks 512 KiB per call (the
  control: the leak check must see it);
- a run whose rank 1 is a straggler: its loss function burns 20 ms of CPU time per micro-batch, as a slower
  device computes (busy, not asleep: a sleeping rank would look like one that waits), a line every step, under
  ddp and under fsdp (whose waits are spread over every block's collectives); and a
  balanced job of 14-20 ms steps, a line every 10 steps (the default), the control.

    disttrain launch --nproc 2 perf_job.py OUT
"""

import logging
import sys
import time

import torch

from disttrain import Trainer, load_config
from disttrain.losses import lm_loss
from disttrain.runtime import exit_process, init_runtime, shutdown

JOB = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.seq_len=16", "data.global_batch_size=8",
       "data.micro_batch_size=4", "train.steps=200", "train.eval_every=0", "log.progress=false", "train.log_every=1",
       "dist.threads_per_rank=1", "parallel.strategy=ddp"]
KEPT: list[torch.Tensor] = []
STRAGGLER_STEPS = 20
BALANCED = ("model.n_layer=2", "model.d_model=128", "model.n_head=4", "model.seq_len=64")  # 14-20 ms steps here


def leaky_loss(outputs, batch):
    KEPT.append(torch.ones(2**17))  # 512 KiB that nobody frees
    return lm_loss(outputs, batch)


def slow_loss(outputs, batch):
    end = time.thread_time() + 0.02
    while time.thread_time() < end:  # CPU time: what the rank computes, however the cores are shared
        pass
    return lm_loss(outputs, batch)


def main() -> None:
    out = sys.argv[1]
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # (the end-of-run line is an INFO message)
    runtime = init_runtime(load_config(None, JOB).dist)
    runs = [("steady", None, 200, 1, ()), ("leaky", leaky_loss, 200, 1, ()),
            ("straggler", slow_loss if runtime.rank == 1 else None, STRAGGLER_STEPS, 1, ()),
            ("straggler_fsdp", slow_loss if runtime.rank == 1 else None, STRAGGLER_STEPS, 1,
             ("parallel.strategy=fsdp",)),
            ("balanced", None, 60, 10, BALANCED)]
    for name, loss_fn, steps, every, model in runs:
        cfg = load_config(None, [*JOB, f"run.out_dir={out}", f"run.name={name}", f"train.steps={steps}",
                                 f"train.log_every={every}", *model])
        Trainer(cfg, runtime=runtime, loss_fn=loss_fn).fit()
    shutdown(runtime)


if __name__ == "__main__":
    main()
    exit_process(0)
