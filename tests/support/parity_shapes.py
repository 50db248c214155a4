"""Parity models about shapes and routing: structured outputs (dict / tuple / namedtuple with
None and non-tensor members), numels the world size does not divide, and a mixture of experts
routed by the data (declared a leaf module). The catalogue is tests/support/parity_models.py."""
from __future__ import annotations

from collections import namedtuple

import torch
import torch.nn.functional as F
from torch import nn

from tests.support.parity_data import GLOBAL_BATCH, _gen

# ---- structured: dict / tuple / namedtuple outputs -----------------------------------------------

Out = namedtuple("Out", "y aux count")


class DictChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.lin2 = nn.Linear(5, 7), nn.Linear(5, 7)

    def forward(self, x: torch.Tensor) -> dict:
        return {"h": self.lin(x), "gate": None, "k": 3, "pair": (torch.sigmoid(self.lin2(x)), None)}


class TupleChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(7, 7)

    def forward(self, x: torch.Tensor) -> tuple:
        return torch.tanh(self.lin(x)), None, "tag"


class NTChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(7, 4)

    def forward(self, x: torch.Tensor) -> Out:
        return Out(y=self.lin(x), aux=None, count=2)


class StructNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.d, self.t, self.n = DictChild(), TupleChild(), NTChild()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> dict:
        d = self.d(x)
        assert d["gate"] is None and d["pair"][1] is None
        h = d["h"] * d["pair"][0] / d["k"]
        y, none, tag = self.t(h)
        assert none is None and tag == "tag"
        o = self.n(y)
        assert o.aux is None
        return {"out": self.head(o.y) * o.count, "extra": None, "meta": "s"}


def _struct_loss(m, b: tuple, i: int) -> torch.Tensor:
    x, y = b
    out = m(x)
    assert out["extra"] is None and out["meta"] == "s"
    return ((out["out"].float() - y) ** 2).mean()


# ---- odd: numels not divisible by the world size, and smaller than it ---------------------------

class OddNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(7, 5)  # 35 + 5
        self.b = nn.Linear(5, 1)  # 5 + 1: bias numel 1
        self.scalar = nn.Parameter(torch.tensor(0.7))  # 0-dim, numel 1
        self.pair = nn.Parameter(torch.tensor([0.3, -0.2]))  # numel 2 < 3
        self.c = nn.Linear(1, 3)  # 3 + 3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.b(torch.tanh(self.a(x))) * self.scalar  # (B, 1)
        return self.c(s) + self.pair[0] - self.pair[1] * s


# ---- moe: experts picked by the data, one leaf module ---------------------------------------------

E = 3


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 7), nn.Linear(7, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class MoEBlock(nn.Module):
    """Top-1 routing: sample n goes to expert argmax(router(r_n)), scaled by its gate prob.
    The router reads a routing feature of the data with a wide margin (weights 4 * I), so the
    choice is the same in fp32 and bf16 and does not flip while training."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(E, E, bias=False)
        with torch.no_grad():
            self.router.weight.copy_(4 * torch.eye(E) + 0.1 * torch.randn(E, E))
        self.experts = nn.ModuleList(Expert() for _ in range(E))
        self.last_used: tuple[int, ...] = ()

    def forward(self, h: torch.Tensor, r: torch.Tensor) -> torch.Tensor:  # h (N, 6), r (N, E)
        probs = self.router(r).softmax(-1)  # (N, E)
        choice = probs.argmax(-1)  # (N,) chosen by the data
        self.last_used = tuple(sorted(set(choice.tolist())))
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            sel = (choice == e).nonzero().squeeze(1)
            if sel.numel():
                out = out.index_add(0, sel, expert(h[sel]) * probs[sel, e:e + 1])
        return h + out


class MoENet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.moe, self.head = nn.Linear(4, 6), MoEBlock(), nn.Linear(6, 2)

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        h = self.moe(torch.tanh(self.inp(x)), r)
        return self.head(self.moe(torch.tanh(h), r))  # the leaf applied twice: reduced once


def _moe_batch(i: int) -> tuple:
    g = _gen(i, 8)
    x, y = torch.randn(GLOBAL_BATCH, 4, generator=g), torch.randn(GLOBAL_BATCH, 2, generator=g)
    pick = torch.randint(0, E, (GLOBAL_BATCH,), generator=g)
    r = F.one_hot(pick, E).float() * 2 + 0.1 * torch.randn(GLOBAL_BATCH, E, generator=g)
    return x, r, y


def _moe_loss(m, b: tuple, i: int) -> torch.Tensor:
    x, r, y = b
    return ((m(x, r).float() - y) ** 2).mean()
