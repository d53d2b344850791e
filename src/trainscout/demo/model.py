"""A tiny GPT for the demo job: the same shape of computation as a real LLM trainer, at laptop scale.

Token embedding + learned positions, pre-norm blocks of causal multi-head attention and a 4x MLP, a final
norm and a vocabulary head. Real attention and real parameters matter: the detectors fingerprint replicated
state and the Flight Recorder sees DDP's gradient buckets, so the demo exercises the same paths a real job does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    seq: int = 32


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.hidden % cfg.heads:
            raise ValueError(f"hidden={cfg.hidden} is not divisible by heads={cfg.heads}")
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        # (B, T, 3C) -> three (B, heads, T, C/heads) tensors, the layout SDPA expects.
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, hidden // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, hidden))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden)
        self.attn = CausalSelfAttention(cfg)
        self.norm2 = nn.LayerNorm(cfg.hidden)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.hidden, 4 * cfg.hidden), nn.GELU(), nn.Linear(4 * cfg.hidden, cfg.hidden)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tokens = nn.Embedding(cfg.vocab, cfg.hidden)
        self.positions = nn.Parameter(torch.zeros(cfg.seq, cfg.hidden))
        nn.init.normal_(self.positions, std=0.02)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) with T <= cfg.seq -> logits (B, T, vocab)."""
        x = self.tokens(idx) + self.positions[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))
