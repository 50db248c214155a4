"""The models of the multi-process parity tests (issue #4), each with its data and its loss.

    MODELS[name] -> ParityModel(build, batch, loss, leaf_classes)
        build()          a fresh model, weights from a fixed seed (same on every rank)
        batch(i)         the GLOBAL micro-batch of micro-step i: a tuple of tensors, each with a
                         leading dim GLOBAL_BATCH (6: split evenly over W in {1, 2, 3})
        loss(m, b, i)    the scalar loss of model (or engine) `m` on the micro-batch `b` at
                         micro-step i: the mean over the samples of `b`
        leaf_classes     classes to pass to fz3.set_leaf_modules before fz3.initialize

Small on purpose (a few dozen to ~2,600 params) and with odd sizes, so shards are padded and
some params are smaller than the world size. What each model is there to exercise:

    gpt        tied token embedding / lm_head (one param, two modules), attention, a bool buffer
    albert     one block applied K times in a forward (pre-backward ref counts, k fetches in
               backward), a float buffer (cast to bf16 in bf16 mode)
    external   a child whose forward returns its own param, used by the parent; a parent that
               reads a child's params without calling it; nn.MultiheadAttention (reads
               out_proj.weight directly, returns (out, None))
    branch     a step-dependent flag (same on every rank) picks one of two submodules and skips
               a third on some steps: trace invalidation, params with no grad in a window
    frozen     requires_grad=False params mixed with trainable ones, whole frozen modules, a
               trainable module whose input needs no grad (no post-backward)
    structured child outputs as dict / tuple / namedtuple with None and non-tensor members,
               consumed by the parent; the root returns a dict too
    odd        numels not divisible by 2 or 3, numel 1 and 2 (< world size 3), a 0-dim param
    moe        mixture of experts picked per sample by argmax of a router on the data, declared a
               leaf module: ranks run different experts, the leaf reduces them all; applied
               twice per forward, it is reduced once, after its last call's backward
    containers direct params returning a frozen dataclass, a torch-pytree-registered class, an
               OrderedDict and a dataclass in a list; the root returns a dataclass
    checkpoint torch.utils.checkpoint, reentrant and not, params used inside and outside the
               regions, one block checkpointed twice (tests/support/parity_habits.py)

Every model also runs forward-only passes (inference_mode, no_grad + eval(), eval() with grad)
before, between and after its steps, and one forward that raises midway (tests/support/parity.py).

[Note: no k-bias] Attention here has no q/k/v bias: the grad of the key bias is zero in exact
arithmetic (softmax is shift invariant) but ~1e-9 noise in floating point, and Adam turns noise
into a full lr-sized step whose sign depends on summation order. That is a property of Adam,
not of sharding, so it is left out of a 1e-5 parity test.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tests.support.parity_data import (GLOBAL_BATCH, ParityModel, _gen, _mse, _regression_batch,
                                     rank_slice)
from tests.support.parity_habits import CheckpointNet, ContainersNet, _containers_loss
from tests.support.parity_shapes import (MoEBlock, MoENet, OddNet, StructNet, _moe_batch, _moe_loss,
                                       _struct_loss)

__all__ = ["MODELS", "GLOBAL_BATCH", "ParityModel", "rank_slice"]


# ---- gpt: tied embeddings ---------------------------------------------------------------------

V, T, D, H = 29, 7, 10, 2  # vocab, context, width, heads (head dim 5)


class GPTBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D, bias=False)  # [Note: no k-bias]
        self.proj = nn.Linear(D, D)
        self.fc, self.out = nn.Linear(D, 3 * D), nn.Linear(3 * D, D)
        self.register_buffer("mask", torch.tril(torch.ones(T, T, dtype=torch.bool)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)  # (B, L, C) each
        q, k, v = (t.view(B, L, H, C // H).transpose(1, 2) for t in (q, k, v))  # (B, H, L, hd)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // H)  # (B, H, L, L)
        att = att.masked_fill(~self.mask[:L, :L], float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, L, C)  # (B, L, C)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(T, D)
        self.blocks = nn.ModuleList(GPTBlock() for _ in range(2))
        self.ln_f = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, V, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one Parameter, two modules

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)  # (B, L, D)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, L, V)


def _gpt_batch(i: int) -> tuple:
    tokens = torch.randint(0, V, (GLOBAL_BATCH, T + 1), generator=_gen(i, 1))
    return tokens[:, :-1], tokens[:, 1:]


def _gpt_loss(m, b: tuple, i: int) -> torch.Tensor:
    idx, tgt = b
    logits = m(idx)
    return F.cross_entropy(logits.reshape(-1, V).float(), tgt.reshape(-1))


# ---- albert: one block applied K times --------------------------------------------------------

K = 3


class SharedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(9, 13), nn.Linear(13, 9)
        self.norm = nn.LayerNorm(9)
        self.alpha = nn.Parameter(torch.full((9,), 0.5))  # the block's own param: its own unit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.alpha * self.lin2(torch.tanh(self.lin1(x))))


class Albert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.block, self.head = nn.Linear(5, 9), SharedBlock(), nn.Linear(9, 3)
        self.register_buffer("gain", torch.tensor([1.5, 0.5, 1.0]))  # float: cast in bf16 mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for _ in range(K):
            h = self.block(h)
        return self.head(h) * self.gain


# ---- external: returned params, params read without a call, nn.MultiheadAttention --------------

class ScaleVec(nn.Module):
    """Its forward returns its own parameter; the caller uses it (an external param)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, n))

    def forward(self) -> nn.Parameter:
        return self.weight


class ExternalNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.scale = ScaleVec(6)
        self.side = nn.Linear(6, 6)  # never called: the parent reads its params
        self.mha = nn.MultiheadAttention(6, 2, bias=False, batch_first=True)  # [Note: no k-bias]
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, L, 4)
        h = self.inp(x) * self.scale()  # (B, L, 6)
        h = torch.tanh(F.linear(h, self.side.weight, self.side.bias))
        a, none = self.mha(h, h, h, need_weights=False)  # (B, L, 6), None
        assert none is None
        return self.head((h + a).mean(1))  # (B, 2)


def _external_batch(i: int) -> tuple:
    g = _gen(i, 3)
    return torch.randn(GLOBAL_BATCH, 3, 4, generator=g), torch.randn(GLOBAL_BATCH, 2, generator=g)


# ---- branch: the forward changes between steps -------------------------------------------------

MODES = (0, 0, 0, 1, 1, 1, 2, 0, 0, 1, 2, 2)  # by micro-step; 0: a + c, 1: b + c, 2: a, c skipped


class BranchNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 8)
        self.a = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, mode: int) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = self.b(h) if mode == 1 else self.a(h)
        if mode != 2:
            h = h + self.c(h)
        return self.head(h)


def _branch_loss(m, b: tuple, i: int) -> torch.Tensor:
    x, y = b
    return ((m(x, MODES[i % len(MODES)]).float() - y) ** 2).mean()


# ---- frozen: requires_grad=False mixed with trainable ------------------------------------------

class FrozenNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(6, 10)  # wholly frozen: its output needs no grad
        self.mid = nn.Linear(10, 10)  # trainable weight, frozen bias; input needs no grad
        self.norm = nn.LayerNorm(10)  # frozen weight, trainable bias
        self.head = nn.Linear(10, 3)
        for p in (self.emb.weight, self.emb.bias, self.mid.bias, self.norm.weight):
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.relu(self.mid(torch.tanh(self.emb(x))))))


# ---- registry ------------------------------------------------------------------------------------

def _seeded(cls: type, seed: int) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(seed)
        return cls()
    build.__name__ = f"build_{cls.__name__}"
    return build


MODELS: dict[str, ParityModel] = {m.name: m for m in (
    ParityModel("gpt", _seeded(TinyGPT, 1), _gpt_batch, _gpt_loss),
    ParityModel("albert", _seeded(Albert, 2), _regression_batch(2, 5, 3), _mse),
    ParityModel("external", _seeded(ExternalNet, 3), _external_batch, _mse),
    ParityModel("branch", _seeded(BranchNet, 4), _regression_batch(4, 5, 2), _branch_loss),
    ParityModel("frozen", _seeded(FrozenNet, 5), _regression_batch(5, 6, 3), _mse),
    ParityModel("structured", _seeded(StructNet, 6), _regression_batch(6, 5, 2), _struct_loss),
    ParityModel("odd", _seeded(OddNet, 7), _regression_batch(7, 7, 3), _mse),
    ParityModel("moe", _seeded(MoENet, 8), _moe_batch, _moe_loss, (MoEBlock,)),
    ParityModel("containers", _seeded(ContainersNet, 9), _regression_batch(9, 5, 2), _containers_loss),
    ParityModel("checkpoint", _seeded(CheckpointNet, 10), _regression_batch(10, 5, 2), _mse),
)}
