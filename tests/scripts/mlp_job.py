"""A non-language job through the Python API: MLP regression, custom datasets and loss.

    python mlp_job.py OUT_DIR [--set k=v ...]                      (one process)
    disttrain launch --nproc 2 mlp_job.py OUT_DIR [--set k=v ...]  (two ranks, torchrun)

Rank 0 writes OUT_DIR/result.json: per-step losses, eval losses, and an eval that counts samples.
"""

import json
import sys
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from disttrain import Trainer, load_config
from disttrain.backend import create_backend
from disttrain.runtime import exit_process, init_runtime, shutdown
from disttrain.trainer import evaluate


def mse(outputs, batch):
    return torch.nn.functional.mse_loss(outputs, batch[1])


def main() -> None:
    out = Path(sys.argv[1])
    overrides = [arg for arg in sys.argv[2:] if arg != "--set"]
    cfg = load_config(None, [f"run.out_dir={out}", "run.name=mlp", "train.steps=15", "data.global_batch_size=12",
                             "data.micro_batch_size=3", "train.eval_every=5", "optim.warmup_steps=2",
                             "optim.lr=0.05", "log.progress=false", "dist.threads_per_rank=1", *overrides])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(50, 1, generator=g)
    train, val = TensorDataset(x[:37], y[:37]), TensorDataset(x[37:], y[37:])  # 37 and 13: uneven splits
    runtime = init_runtime(cfg.dist)
    torch.manual_seed(cfg.run.seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    result = Trainer(cfg, model=model, train_dataset=train, eval_dataset=val, loss_fn=mse, runtime=runtime).fit()

    # Each validation sample exactly once: the "loss" of a sample is its index, so the sum is 0+1+...+12.
    ids = TensorDataset(torch.zeros(13, 1), torch.arange(13, dtype=torch.float64))
    probe = create_backend(torch.nn.Linear(1, 1), lambda m: torch.optim.SGD(m.parameters(), lr=0.0),
                           runtime=runtime, loss_fn=lambda out, batch: (batch[1].sum(), len(batch[1])))
    mean_id, counted = evaluate(probe, ids, runtime, micro_batch_size=2)
    if runtime.is_main_process():
        (out / "result.json").write_text(json.dumps({
            "losses": result.losses, "eval_losses": result.eval_losses, "world": runtime.world_size,
            "id_sum": mean_id * counted, "id_count": counted}))
    del probe, model  # see runtime.shutdown: nothing holding the process group may outlive it
    shutdown(runtime)


if __name__ == "__main__":
    main()
    exit_process(0)
