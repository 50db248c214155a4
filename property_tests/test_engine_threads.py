"""I7 at the engine's level, drawn: the real engine and interpreter on 1-3 ranks that are threads of
one process (fz3.launch.run_threads) train drawn models under drawn configs like plain PyTorch.

The model grammar: a chain of Linear layers of drawn widths (odd sizes give padded shards); a
layer may be called twice (its params reused in one pass), one may be frozen, the last may be
tied to the first (one Parameter in two modules). Configs: every size that decides timing
(persistence threshold, prefetch bucket, live budget, reuse distance, reduce bucket), overlap_comm,
gradient accumulation of 1-2 micro-steps. The reference: single-process SGD on the same data,
each rank's slice of the batch, grads averaged over ranks and micro-steps ([Note: the reference],
tests/support/parity.py). Tolerance: fp32, rtol 1e-5 and atol 1e-6 (sums over ranks in another
order than one process adds them; tests/test_parity.py says why).
"""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fz3 import launch
from fz3.config.config import Config

STEPS = 2


class Chain(nn.Module):
    def __init__(self, widths: list[int], twice: int, frozen: int, tied: bool, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))
        self.twice = twice  # this layer runs twice (square layers only), -1: none
        if 0 <= frozen < len(self.layers):
            self.layers[frozen].weight.requires_grad_(False)
        first, last = self.layers[0], self.layers[-1]
        if tied and last is not first and first.weight.shape == last.weight.shape:
            last.weight = first.weight

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i == self.twice and layer.in_features == layer.out_features:
                x = torch.tanh(layer(x))
        return x


@st.composite
def cases(draw):
    widths = draw(st.lists(st.integers(1, 9), min_size=2, max_size=5))
    n, tied = len(widths) - 1, draw(st.booleans())
    if tied and n >= 2:  # the last layer's weight takes the first's shape
        widths[-2] = widths[0]
        widths[-1] = widths[1]
    model = dict(widths=widths, twice=draw(st.integers(-1, n - 1)), frozen=draw(st.integers(-1, n)),
                 tied=tied, seed=draw(st.integers(0, 100)))
    sizes = st.sampled_from([0, 1, 7, 30, 10**9])
    config = dict(param_persistence_threshold=draw(st.sampled_from([0, 5, 10**5])),
                  prefetch_bucket_size=draw(sizes), max_live_parameters=draw(st.sampled_from([0, 20, 10**9])),
                  max_reuse_distance=draw(sizes), reduce_bucket_size=draw(st.sampled_from([1, 16, 100, 10**9])),
                  overlap_comm=draw(st.booleans()), gradient_accumulation_steps=draw(st.integers(1, 2)))
    return model, config, draw(st.integers(1, 3))


def _batch(i: int, width: int, world: int) -> torch.Tensor:
    return torch.randn(2 * world, width, generator=torch.Generator().manual_seed(i))


def _train(rank: int, world: int, model_args: dict, config: dict) -> dict:
    import fz3
    net = Chain(**model_args)
    engine = fz3.initialize(net, torch.optim.SGD([p for p in net.parameters()], lr=0.25), Config(**config))
    losses = []
    for i in range(STEPS * config["gradient_accumulation_steps"]):
        x = _batch(i, model_args["widths"][0], world)[2 * rank:2 * rank + 2]
        loss = engine(x).square().sum()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "state": engine.full_state_dict()}


def _reference(model_args: dict, config: dict, world: int) -> tuple[list[list[float]], dict]:
    net = Chain(**model_args)
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.25)
    gas, losses = config["gradient_accumulation_steps"], []
    for i in range(STEPS * gas):
        if i % gas == 0:
            for p in params:
                p.grad = torch.zeros_like(p)
        x = _batch(i, model_args["widths"][0], world)
        per_rank = [net(x[2 * r:2 * r + 2]).square().sum() for r in range(world)]
        (sum(per_rank) / (world * gas)).backward()
        losses.append([l.item() for l in per_rank])
        if i % gas == gas - 1:
            opt.step()
    return losses, net.state_dict()


@settings(max_examples=60, deadline=None)
@given(cases())
def test_the_engine_on_thread_ranks_trains_drawn_models_like_plain_pytorch(case):
    model_args, config, world = case
    outs = launch.run_threads(_train, world, args=(model_args, config), timeout_s=120)
    ref_losses, ref_state = _reference(model_args, config, world)
    for r, out in enumerate(outs):
        got = torch.tensor(out["losses"])
        want = torch.tensor([step[r] for step in ref_losses])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {r} losses: {m}")
    assert outs[0]["state"].keys() == ref_state.keys()
    for name, want in ref_state.items():
        torch.testing.assert_close(outs[0]["state"][name], want, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name}: {m}")
