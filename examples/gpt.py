"""A small GPT (nanoGPT's shape) and a synthetic token stream, for the main job and benchmarks.

    model = GPT(GPTConfig(vocab=256, d_model=64, n_head=4, n_layer=2, seq=32))
    x, y = markov_batch(step, batch=8, seq=32, vocab=256)   # (B, T) int64, y = x shifted by one

The token embedding and the lm_head share one Parameter (weight tying), the case ZeRO-3 must
not gather twice nor update twice. The data is a fixed random Markov chain, so the loss has
something to learn and falls visibly within tens of steps; it needs no download.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256
    d_model: int = 64
    n_head: int = 4
    n_layer: int = 2
    seq: int = 32


class Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(c.d_model)
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model)
        self.proj = nn.Linear(c.d_model, c.d_model)
        self.ln2 = nn.LayerNorm(c.d_model)
        self.fc = nn.Linear(c.d_model, 4 * c.d_model)
        self.out = nn.Linear(4 * c.d_model, c.d_model)
        self.n_head = c.n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)  # each (B, T, C)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.config = c
        self.wte = nn.Embedding(c.vocab, c.d_model)
        self.wpe = nn.Embedding(c.seq, c.d_model)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.d_model)
        self.lm_head = nn.Linear(c.d_model, c.vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one Parameter, one ParamId
        for name, p in self.named_parameters():  # nanoGPT's init: N(0, 0.02), zero biases
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab)


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def markov_batch(step: int, *, batch: int, seq: int, vocab: int, seed: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences from a fixed random Markov chain: each token picks among 4 likely successors."""
    table = torch.randint(vocab, (vocab, 4), generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed * 1_000_003 + step + 1)
    tokens = torch.empty(batch, seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(vocab, (batch,), generator=g)
    choice = torch.randint(4, (batch, seq), generator=g)
    for t in range(seq):
        tokens[:, t + 1] = table[tokens[:, t], choice[:, t]]
    return tokens[:, :-1], tokens[:, 1:]
