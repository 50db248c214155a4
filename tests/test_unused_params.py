"""A trainable param that got no gradient in a whole accumulation window is not stepped: its
optimizer grad is None, as in plain PyTorch and FSDP2 ([Note: no grad, no step],
fz3/core/grad/epilogue.py).

The model: an auxiliary head that is never called (a branch not taken), and a leaf module of
three experts (fz3.set_leaf_modules) where expert 0 sees rows on every rank, expert 1 on the
last rank only, expert 2 on none. AdamW with weight decay, two accumulation steps, on 2 and 3
thread ranks and 2 gloo processes: the optimizer holds state only for the params plain
PyTorch's does, and the params no grad reached are bit for bit their initial values, exact by
construction (no op touches them). Zeros in place of the missing grads moved them by AdamW's
decay and moments: 7e-4 away after a few steps.

The stepped params, and the next forward, equal plain PyTorch's within 4 ulp (rtol 5e-7): the
grads are exact (sums of small integers, divided once by W x gas), but AdamW's elementwise
kernels round by where an element falls, a vector lane (FMA) or the scalar tail, and fz3 steps
flat shards where plain PyTorch steps whole tensors. At 3 ranks MKL's AVX-512 path and its AVX2
path differ there in the last bit (7.45e-9 on a weight near 0.1).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fz3 import launch

pytestmark = pytest.mark.timeout(300)

GAS, STEPS, ROWS = 2, 3, 2


class Experts(nn.Module):
    """Rows go to expert int(x[:, 0]) (0, 1 or 2); only experts that got rows run."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(3, 3) for _ in range(3))

    def forward(self, x):
        out = torch.zeros_like(x)
        route = x[:, 0].long().clamp(0, 2)
        for e, expert in enumerate(self.experts):
            rows = (route == e).nonzero()[:, 0]
            if len(rows):
                out = out.index_put((rows,), expert(x[rows]))
        return out


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.moe, self.out = nn.Linear(3, 3), Experts(), nn.Linear(3, 1)
        self.aux = nn.Linear(3, 1)  # never called
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randint(-1, 2, p.shape, generator=g).float())

    def forward(self, x):  # x: (B, 3), column 0 the route
        h = torch.cat([x[:, :1], self.inp(x)[:, 1:]], dim=1)  # (B, 3): the route passes through
        return self.out(torch.relu(self.moe(h)))


def batch(window: int, micro: int, rank: int, world: int) -> torch.Tensor:
    """ROWS rows (route, two features): route 0 on every rank, 1 on the last rank only, never 2."""
    g = torch.Generator().manual_seed(1000 * window + 10 * micro + rank)
    feats = torch.randint(-1, 2, (ROWS, 2), generator=g).float()
    route = torch.tensor([0.0, 1.0 if rank == world - 1 else 0.0])
    return torch.cat([route[:, None], feats], dim=1)


def optimizer(params):
    return torch.optim.AdamW(params, lr=2.0 ** -4, weight_decay=0.25)


def _train(rank: int, world: int) -> dict:
    import fz3
    model = Net()
    fz3.set_leaf_modules(model, [Experts])
    engine = fz3.initialize(model, optimizer(model.parameters()),
                            fz3.Config(gradient_accumulation_steps=GAS, param_persistence_threshold=0))
    for w in range(STEPS):
        for m in range(GAS):
            engine.backward(engine(batch(w, m, rank, world)).sum())
            engine.step()
    names = dict(zip(map(id, engine.store.masters), engine.tables.names))
    with torch.no_grad():
        after = engine(batch(STEPS, 0, rank, world)).sum().item()
    return {"state": engine.full_state_dict(), "after": after,
            "stepped": sorted(names[id(m)] for m in engine.optimizer.state)}


def _reference(world: int) -> dict:
    model = Net()
    opt = optimizer(model.parameters())
    for w in range(STEPS):
        opt.zero_grad()  # set_to_none: a param no row reached has grad None, and AdamW skips it
        for m in range(GAS):
            for r in range(world):
                model(batch(w, m, r, world)).sum().backward()
        for p in model.parameters():
            if p.grad is not None:
                p.grad /= world * GAS
        opt.step()
    names = {id(p): n for n, p in model.named_parameters()}
    with torch.no_grad():
        after = [model(batch(STEPS, 0, r, world)).sum().item() for r in range(world)]
    return {"state": model.state_dict(), "after": after,
            "stepped": sorted(names[id(p)] for p in opt.state)}


ULPS = dict(rtol=5e-7, atol=1e-9)  # AdamW's lanes and tail round apart: see the module docstring


def assert_equal(outs: list[dict], world: int) -> None:
    ref = _reference(world)
    assert "aux.weight" not in ref["stepped"] and "moe.experts.2.weight" not in ref["stepped"]
    assert "moe.experts.1.weight" in ref["stepped"]
    initial = Net().state_dict()
    for r, out in enumerate(outs):
        assert out["stepped"] == ref["stepped"], r
        torch.testing.assert_close(out["after"], ref["after"][r], **ULPS)
        for k, v in ref["state"].items():
            if k.removesuffix(".weight").removesuffix(".bias") + ".weight" in ref["stepped"]:
                torch.testing.assert_close(out["state"][k], v, **ULPS, msg=lambda m: f"rank {r}, {k}: {m}")
            else:  # never stepped: untouched, here and in plain PyTorch
                assert torch.equal(v, initial[k]) and torch.equal(out["state"][k], v), (r, k)


@pytest.mark.parametrize("world", [2, 3])
def test_unused_params_are_not_stepped_on_thread_ranks(world):
    assert_equal(launch.run_threads(_train, world), world)


def test_unused_params_are_not_stepped_on_gloo_processes():
    assert_equal(launch.run(_train, world_size=2, timeout=120), 2)
