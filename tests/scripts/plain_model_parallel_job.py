"""Two ranks: the hand-written pipeline (1f1b, gpipe) and tensor-parallel loops of `bench overhead` train four steps;
rank 1 writes their losses and those of the same GPT, data and AdamW in one process to OUT/losses.json. Then the
hand-written ddp and fsdp loops in fp32 and bf16-mixed, and disttrain's own step in bf16-mixed (mean losses over the
ranks): OUT/precision.json."""

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from disttrain.bench import loops, overhead, plain_model_parallel
from disttrain.config import load_config
from disttrain.data import fetch
from disttrain.models.gpt import GPT
from disttrain.optim import scheduler_factory
from disttrain.runtime import exit_process, shutdown

out = Path(sys.argv[1])
small = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.seq_len=16"]
config = lambda name, micro, precision="fp32": load_config(  # noqa: E731
    None, [*small, "data.global_batch_size=8", f"data.micro_batch_size={micro}", "dist.threads_per_rank=1",
           "train.steps=100", "dist.nproc=2", f"parallel.precision={precision}", *overhead.settings(name)])
runtime, train, sampler = overhead.start_worker(config("pp2", 4))
losses = {}
for name, micro in (("pp2", 4), ("pp2-gpipe", 4), ("tp2", 8)):  # tp2: one micro-batch, so its loss is the step's
    step = loops.plain_loop(config(name, micro), runtime, train, sampler)
    losses[name] = [step(k) for k in range(4)]
cfg = config("tp2", 8)
torch.manual_seed(cfg.run.seed)
model = GPT(cfg.model)
optimizer = plain_model_parallel.hand_written_adamw(model, cfg.optim)
scheduler = scheduler_factory(cfg.optim, cfg.train.steps)(optimizer)
losses["one process"] = []
for k in range(4):
    batch = fetch(train, sampler.rank_indices(k * 8, 8, 1, 0))
    loss = F.cross_entropy(model(batch["input_ids"]).flatten(0, 1), batch["labels"].flatten())
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    losses["one process"].append(loss.item())
if runtime.rank == 1:  # the last stage holds the pipeline's loss
    (out / "losses.json").write_text(json.dumps(losses))


def world_mean(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    torch.distributed.all_reduce(t)
    return t.item() / runtime.world_size


precision = {}
for strategy in ("ddp", "fsdp"):
    for name in ("fp32", "bf16-mixed"):
        hand = loops.plain_loop(config(strategy, 4, name), runtime, train, sampler)
        precision[f"{strategy} {name} hand-written"] = [world_mean(hand(k)) for k in range(4)]
    ours = loops.disttrain_loop(config(strategy, 4, "bf16-mixed"), runtime, train, sampler)
    precision[f"{strategy} bf16-mixed disttrain"] = [ours(k)["loss"] for k in range(4)]
if runtime.rank == 0:
    (out / "precision.json").write_text(json.dumps(precision))
shutdown(runtime)
exit_process(0)  # (gloo's threads abort a normal interpreter exit now and then: runtime.exit_process)
