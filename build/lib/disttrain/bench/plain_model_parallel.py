"""The hand-written pipeline and tensor-parallel loops that `disttrain bench overhead` compares disttrain's step with:
what a user writes from the `torch.distributed.pipelining` and tensor-parallel tutorials, kept plain and short.

Both split the reference GPT over all ranks (no data axis), so every rank reads the whole global batch, as
disttrain's layout does. Neither clips gradients (the tutorials do not; `bench overhead` sets optim.grad_clip = 0
for these layouts on both sides). Each `*_loop(cfg, runtime, train, sampler)` returns `step(k) -> loss`.
`hand_written_adamw` is the optimizer of every hand-written loop of the benchmarks (data-parallel ones too).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from disttrain.data import fetch, split_micro
from disttrain.models.gpt import GPT
from disttrain.optim import scheduler_factory


def hand_written_adamw(model, optim):
    """AdamW as the tutorials write it (torch's default implementation), with the same parameter groups and
    hyper-parameters as disttrain's factory, which picks torch's fused kernel where there is one."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": optim.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.beta1, optim.beta2))


class Stage(nn.Module):
    """Stage `rank` of `stages` of the GPT, split by hand: consecutive blocks, the embeddings on the first stage,
    the final norm and the (tied) head on the last."""

    def __init__(self, gpt: GPT, rank: int, stages: int):
        super().__init__()
        n = len(gpt.blocks)
        self.first, self.last = rank == 0, rank == stages - 1
        self.blocks = nn.ModuleList(gpt.blocks[rank * n // stages:(rank + 1) * n // stages])
        if self.first:
            self.tok_emb, self.pos_emb = gpt.tok_emb, gpt.pos_emb
        if self.last:
            self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.last else x


def pipeline_loop(cfg, runtime, train, sampler):
    """One stage per rank: `PipelineStage` with static shapes, `Schedule1F1B` (or GPipe) with `scale_grads=False`
    and a token-sum loss, the tied embedding/head gradient summed between the first and last stage, gradients
    divided by the step's token count, AdamW."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank, stages, device = runtime.rank, runtime.world_size, runtime.device
    d, m = cfg.data, cfg.model
    torch.manual_seed(cfg.run.seed)
    stage = Stage(GPT(m), rank, stages).to(device)
    shape = (d.micro_batch_size, m.seq_len)
    x = torch.empty(shape, dtype=torch.long, device="meta") if stage.first else \
        torch.empty((*shape, m.d_model), device="meta", requires_grad=True)
    y = torch.empty((*shape, m.vocab_size if stage.last else m.d_model), device="meta", requires_grad=True)
    pipe = PipelineStage(stage, rank, stages, device, input_args=(x,), output_args=(y,))

    def loss_fn(logits, labels):
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")

    schedule_class = ScheduleGPipe if cfg.parallel.pipeline_schedule == "gpipe" else Schedule1F1B
    schedule = schedule_class(pipe, n_microbatches=d.global_batch_size // d.micro_batch_size, loss_fn=loss_fn,
                              scale_grads=False)
    optimizer = hand_written_adamw(stage, cfg.optim)
    scheduler = scheduler_factory(cfg.optim, cfg.train.steps)(optimizer)
    tie_group = dist.new_group([0, stages - 1])  # the embedding and the head share one weight

    def step(k: int) -> float:
        batch = {key: v.to(device) for key, v in
                 fetch(train, sampler.rank_indices(k * d.global_batch_size, d.global_batch_size, 1, 0)).items()}
        losses: list[torch.Tensor] = []
        if stage.first:
            schedule.step(batch["input_ids"])
        elif stage.last:
            schedule.step(target=batch["labels"], losses=losses)
        else:
            schedule.step()
        if stage.first or stage.last:
            dist.all_reduce(stage.lm_head.weight.grad if stage.last else stage.tok_emb.weight.grad, group=tie_group)
        tokens = batch["labels"].numel()
        for p in stage.parameters():
            p.grad /= tokens
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return float(sum(loss.detach() for loss in losses)) / tokens if losses else 0.0

    return step


def tensor_loop(cfg, runtime, train, sampler):
    """The tensor-parallel tutorial's plan on every block (q, k, v and the MLP's first matrix column-wise, the
    output projections row-wise), the embedding split by vocabulary rows and the head by vocabulary columns with
    its logits gathered, the tie restored; mean loss over the step's micro-batches, AdamW."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    device, d = runtime.device, cfg.data
    mesh = init_device_mesh(device.type, (runtime.world_size,))
    torch.manual_seed(cfg.run.seed)
    model = GPT(cfg.model).to(device)
    block_plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
                  "mlp.0": ColwiseParallel(), "attn.proj": RowwiseParallel(), "mlp.2": RowwiseParallel()}
    for block in model.blocks:
        parallelize_module(block, mesh, block_plan)
    parallelize_module(model, mesh, {"tok_emb": RowwiseParallel(input_layouts=Replicate()),
                                     "lm_head": ColwiseParallel(output_layouts=Replicate())})
    model.lm_head.weight = model.tok_emb.weight  # tied again: both are split by vocabulary rows
    optimizer = hand_written_adamw(model, cfg.optim)
    scheduler = scheduler_factory(cfg.optim, cfg.train.steps)(optimizer)
    micro_batches = d.global_batch_size // d.micro_batch_size

    def step(k: int) -> float:
        indices = sampler.rank_indices(k * d.global_batch_size, d.global_batch_size, 1, 0)
        for idx in split_micro(indices, d.micro_batch_size):
            batch = {key: v.to(device) for key, v in fetch(train, idx).items()}
            logits = model(batch["input_ids"])
            loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()) / micro_batches
            loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step
