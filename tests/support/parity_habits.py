"""Parity models for habits of real models (issue #10): outputs of any structure, and
activation checkpointing. The catalogue is tests/support/parity_models.py.

    containers   modules with direct nn.Parameters (CLIP's logit_scale) returning a frozen
                 dataclass, a class registered with torch.utils._pytree, an OrderedDict and a
                 dataclass nested in a list; the root returns a dataclass too
    checkpoint   torch.utils.checkpoint with use_reentrant=True and False; the embedding's
                 weight used inside and outside the checkpointed regions; one block checkpointed
                 twice per forward (once each way)
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict

import torch
from torch import nn
from torch.utils import _pytree
from torch.utils.checkpoint import checkpoint

# ---- containers: dataclasses, registered pytrees, OrderedDict --------------------------------


@dataclasses.dataclass(frozen=True)
class Scaled:
    """A frozen dataclass, with a field no __init__ sets: rebuilt field by field."""
    logits: torch.Tensor
    scale: torch.Tensor
    tag: str = "scaled"
    count: int = dataclasses.field(default=2, init=False)


class Pair:
    """A plain class its library registers with torch.utils._pytree (as HF registers ModelOutput)."""

    def __init__(self, first, second) -> None:
        self.first, self.second = first, second


_pytree.register_pytree_node(Pair, lambda p: ([p.first, p.second], None),
                             lambda values, _: Pair(*values))


@dataclasses.dataclass
class Result:
    out: torch.Tensor
    extras: list


class ScaledLinear(nn.Module):
    """A direct parameter (like CLIP's logit_scale) beside a child, returning a dataclass."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(n_in, n_out)
        self.logit_scale = nn.Parameter(torch.tensor(0.3))

    def forward(self, x: torch.Tensor) -> Scaled:
        return Scaled(self.lin(x) * self.logit_scale.exp(), self.logit_scale)


class PairChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 6))
        self.lin = nn.Linear(6, 6)

    def forward(self, h: torch.Tensor) -> Pair:
        return Pair(OrderedDict(h=torch.tanh(self.lin(h)) * self.gain, none=None),
                    [Scaled(h * self.gain, self.gain.sum())])


class ContainersNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = ScaledLinear(5, 6), PairChild()
        self.head = nn.Linear(6, 2)
        self.bias = nn.Parameter(torch.tensor([0.1, -0.1]))  # the root's own direct param

    def forward(self, x: torch.Tensor) -> Result:
        s = self.a(x)
        assert (s.tag, s.count) == ("scaled", 2)
        p = self.b(s.logits)
        assert p.first["none"] is None
        inner = p.second[0]
        h = p.first["h"] + 0.1 * inner.logits * s.scale + 0.01 * inner.scale
        return Result(self.head(h) + self.bias, [Scaled(h, s.scale)])


def _containers_loss(m, b: tuple, i: int) -> torch.Tensor:
    x, y = b
    r = m(x)
    assert isinstance(r, Result) and r.extras[0].tag == "scaled"
    return ((r.out.float() - y) ** 2).mean()


# ---- checkpoint: activation checkpointing, reentrant and not ---------------------------------

class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)
        self.alpha = nn.Parameter(torch.full((8,), 0.7))

    def forward(self, h: torch.Tensor, emb_weight: torch.Tensor) -> torch.Tensor:
        # reads the embedding's weight: a param used inside and outside the region
        return self.norm(h + self.alpha * torch.tanh(self.fc(h))) + 0.05 * emb_weight.mean(1)


class CheckpointNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(5, 8)
        self.shared, self.other = Block(), Block()
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        w = self.emb.weight
        h = self._region(self.shared, h, w, reentrant=True)
        h = self._region(self.other, h, w, reentrant=False)
        h = self._region(self.shared, h, w, reentrant=False)  # the same block again
        return self.head(h)

    @staticmethod
    def _region(block: nn.Module, h: torch.Tensor, w: torch.Tensor, *, reentrant: bool) -> torch.Tensor:
        if not torch.is_grad_enabled():  # as Hugging Face models: no checkpointing without grad
            return block(h, w)
        return checkpoint(block, h, w, use_reentrant=reentrant)
