"""The reference GPT: a small decoder-only transformer, the default workload.

Pre-norm blocks, causal `scaled_dot_product_attention`, GELU MLP, tied input/output embeddings.
`blocks` is a plain ModuleList so that strategies can wrap each block (FSDP, activation checkpointing).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from disttrain.config import ModelConfig


class CausalSelfAttention(nn.Module):
    """Separate q, k and v projections, so that tensor parallelism splits each by whole heads
    (parallel/tensor.py); the head count comes from the projection's width, so a rank's shard runs its own heads."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_head
        self.q = nn.Linear(cfg.d_model, cfg.d_model)
        self.k = nn.Linear(cfg.d_model, cfg.d_model)
        self.v = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout
        self.attention_fn = F.scaled_dot_product_attention
        """What attends (context parallelism gives each rank its own: parallel/context.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (proj(x).view(b, t, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        dropout = self.dropout if self.training else 0.0
        y = self.attention_fn(q, k, v, is_causal=True, dropout_p=dropout)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model)
        )
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # tied embeddings
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2 scaled init of residual projections
            if name.endswith(("proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (batch, time) -> logits (batch, time, vocab). `position_ids` (batch, time): each token's position
        (default 0, 1, 2, ...; a rank's pieces of a longer sequence under context parallelism: its own)."""
        t = input_ids.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens exceeds model.seq_len = {self.cfg.seq_len}")
        pos = torch.arange(t, device=input_ids.device) if position_ids is None else position_ids
        x = self.drop(self.tok_emb(input_ids) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))
