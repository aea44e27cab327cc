"""An independent plain-torch training loop, the reference disttrain's strategies are compared against.

Nothing of disttrain's training code runs here: plain `torch.optim` AdamW/SGD with weight decay on matrices
only, the global batch drawn as the sampler defines it (stream position p is `perm(seed, p // N)[p % N]`, step
s takes positions [s*G, (s+1)*G)), one forward over the whole global batch, the token mean of the
cross-entropy over it, `torch.nn.utils.clip_grad_norm_`, and the warmup + cosine schedule written out.
Only the model's definition and the built-in text come from disttrain (they are what is trained, not how).
If disttrain averaged, summed or clipped gradients differently, the per-step grad norms and the final
parameters would differ from this loop's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class Reference:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    params: dict[str, torch.Tensor] = field(default_factory=dict)


def windows(tokens: np.ndarray, seq_len: int) -> torch.Tensor:
    """Non-overlapping (seq_len + 1)-token windows, one per row."""
    n = (len(tokens) - 1) // seq_len
    return torch.stack([torch.from_numpy(np.asarray(tokens[i * seq_len:i * seq_len + seq_len + 1], dtype=np.int64))
                        for i in range(n)])


def global_batch_rows(num_samples: int, seed: int, step: int, global_batch: int) -> list[int]:
    rows = []
    for pos in range(step * global_batch, (step + 1) * global_batch):
        epoch, offset = divmod(pos, num_samples)
        rows.append(int(np.random.default_rng([seed, epoch]).permutation(num_samples)[offset]))
    return rows


def schedule(warmup: int, total: int, min_ratio: float):
    """LR multiplier of step s (0-based): linear warmup to 1, then cosine down to min_ratio at `total`."""
    def factor(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        progress = min(1.0, (s - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def train(model: torch.nn.Module, data: torch.Tensor, *, seed: int, global_batch: int, steps: int, optim: str,
          lr: float, weight_decay: float, betas: tuple[float, float], grad_clip: float,
          lr_factor=lambda s: 1.0) -> Reference:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [g for g in ({"params": decay, "weight_decay": weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    if optim == "sgd":
        optimizer = torch.optim.SGD(groups, lr=lr, momentum=betas[0])
    else:
        optimizer = torch.optim.AdamW(groups, lr=lr, betas=betas)
    out = Reference()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr * lr_factor(step)
        batch = data[global_batch_rows(len(data), seed, step, global_batch)]
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="mean")
        loss.backward()
        if grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out.losses.append(loss.item())
        out.grad_norms.append(norm.item())
    out.params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return out


def from_config(cfg) -> Reference:
    """The plain loop for a disttrain `Config` of the built-in GPT on the built-in text."""
    from disttrain.data import synthetic_corpus
    from disttrain.models import build_model

    assert cfg.data.source == "builtin" and cfg.data.shuffle and cfg.model.dropout == 0.0
    tokens = synthetic_corpus()
    data = windows(tokens[:int(len(tokens) * (1.0 - cfg.data.val_fraction))], cfg.model.seq_len)
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model)
    o = cfg.optim
    return train(model, data, seed=cfg.run.seed, global_batch=cfg.data.global_batch_size, steps=cfg.train.steps,
                 optim=o.name, lr=o.lr, weight_decay=o.weight_decay, betas=(o.beta1, o.beta2), grad_clip=o.grad_clip,
                 lr_factor=schedule(o.warmup_steps, cfg.train.steps, o.min_lr_ratio))


def compare(got_losses, got_norms, got_params: dict, ref: Reference, *, loss_tol: float = 1e-5,
            norm_rtol: float = 1e-4, param_tol: float = 1e-5) -> list[str]:
    """What differs between a run and the reference (empty when they match), one line per finding."""
    problems = []
    if len(got_losses) != len(ref.losses):
        return [f"{len(got_losses)} steps, reference {len(ref.losses)}"]
    loss_diff = max(abs(a - b) for a, b in zip(got_losses, ref.losses, strict=True))
    if loss_diff > loss_tol:
        problems.append(f"max |loss diff| {loss_diff:.3g} > {loss_tol}")
    norm_diff = max(abs(a - b) / max(b, 1e-12) for a, b in zip(got_norms, ref.grad_norms, strict=True))
    if not norm_diff <= norm_rtol:
        problems.append(f"max relative grad_norm diff {norm_diff:.3g} > {norm_rtol}")
    missing = set(ref.params) - set(got_params)  # a tied weight may appear under both names in a state dict
    if missing:
        return problems + [f"parameters missing from the run: {sorted(missing)}"]
    param_diff = max((got_params[k].float() - ref.params[k].float()).abs().max().item() for k in ref.params)
    if not param_diff <= param_tol:
        problems.append(f"max |final parameter diff| {param_diff:.3g} > {param_tol}")
    return problems
