"""Two 200-step runs in one process group: the default loop, and the same loop with a loss function that leaks
512 KiB per call (the control: the leak check must see it).

    disttrain launch --nproc 2 leak_job.py OUT
"""

import sys

import torch

from disttrain import Trainer, load_config
from disttrain.losses import lm_loss
from disttrain.runtime import exit_process, init_runtime, shutdown

JOB = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.seq_len=16", "data.global_batch_size=8",
       "data.micro_batch_size=4", "train.steps=200", "train.eval_every=0", "log.progress=false", "train.log_every=1",
       "dist.threads_per_rank=1", "parallel.strategy=ddp"]
KEPT: list[torch.Tensor] = []


def leaky_loss(outputs, batch):
    KEPT.append(torch.ones(2**17))  # 512 KiB that nobody frees
    return lm_loss(outputs, batch)


def main() -> None:
    out = sys.argv[1]
    runtime = init_runtime(load_config(None, JOB).dist)
    for name, loss_fn in (("steady", None), ("leaky", leaky_loss)):
        cfg = load_config(None, [*JOB, f"run.out_dir={out}", f"run.name={name}"])
        Trainer(cfg, runtime=runtime, loss_fn=loss_fn).fit()
    shutdown(runtime)


if __name__ == "__main__":
    main()
    exit_process(0)
