"""[Note: inert modules] (fz3/shell/engine.py): a module whose own params are all persistent, or
that has none, gets no autograd nodes; the others (and the root) get theirs. One gloo rank."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fz3.launch import run

pytestmark = pytest.mark.timeout(120)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 16))  # a container: no params
        self.head = nn.Linear(16, 2)

    def forward(self, x):
        return self.head(self.block(x))


def _worker(rank: int, world: int) -> dict:
    import fz3

    torch.manual_seed(0)
    net = Net()
    engine = fz3.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1),
                            fz3.Config(param_persistence_threshold=20))  # LayerNorm(8): persistent
    names = engine.tables.module_names
    ran: list[tuple[str, str]] = []
    pre, post = engine._pre_backward, engine._post_backward
    # what autograd ran of fz3's (a PreBackward node or its pre-hook, a PostBackward node), by module
    engine._pre_backward = lambda m: (ran.append(("pre", names[m] or "<root>")), pre(m))[1]
    engine._post_backward = lambda m: (ran.append(("post", names[m] or "<root>")), post(m))[1]
    x = torch.randn(3, 8, requires_grad=True)
    counts = []
    for _ in range(2):
        ran.clear()
        engine.backward(engine(x).square().sum())
        counts.append(sorted(ran))
        engine.step()
    return {"counts": counts, "stats": engine.stats()}


def test_inert_modules_get_no_autograd_nodes():
    """root, block.1 and head each get a PreBackward node (or its pre-hook: [Note: a pre-hook for
    one output], fz3/shell/hooks.py) on their outputs, and the root a PostBackward node on its
    inputs; block (a container) and block.0 (LayerNorm(8), persistent under threshold 20) get
    nothing. block.1 and head, every own param trainable, are released by their grads: no
    PostBackward node ([Note: released by its grads], fz3/core/calls.py)."""
    out = run(_worker, world_size=1, timeout=90)[0]
    want = [("post", "<root>"), ("pre", "<root>"), ("pre", "block.1"), ("pre", "head")]
    assert out["counts"] == [want] * 2, out["counts"]
    assert out["stats"]["optimizer_steps"] == 2


def _two_linears():
    """Every param persistent: every module but the root inert (and quiet: none is freed)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


def _input(rank: int, step: int) -> torch.Tensor:
    return torch.arange(12, dtype=torch.float32).reshape(3, 4) / 10 * (rank + 1) - step


def _trained(net, rank: int, loss_of, bare: bool = False, gas: int = 1) -> dict:
    """Two optimizer steps of SGD, `gas` micro-steps each, the loss of micro-step i
    `loss_of(engine, rank, i)`; `bare`: its backward by loss.backward(), not engine.backward.
    step() after every backward, as DeepSpeed's loop calls it: the window closes at the gas-th."""
    import fz3

    engine = fz3.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1),
                            fz3.Config(gradient_accumulation_steps=gas))
    for micro in range(2 * gas):
        loss = loss_of(engine, rank, micro)
        loss.backward() if bare else engine.backward(loss)
        engine.step()
    return {"state": engine.full_state_dict(), "steps": engine.optimizer_steps}


def _as_plain_torch(worker, gas: int = 1) -> None:
    """On 2 thread ranks, the first Linear's output squared and summed as each rank's loss:
    the same params as plain torch on the mean of the ranks' losses (and of the micro-steps')."""
    from fz3.launch import run_threads

    outs = run_threads(worker, 2)
    ref = _two_linears()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        opt.zero_grad()
        micro = range(step * gas, (step + 1) * gas)
        (sum(ref[0](_input(r, i)).square().sum() for r in range(2) for i in micro) / (2 * gas)).backward()
        opt.step()
    for out in outs:
        assert out["steps"] == 2
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(out["state"][name], value, msg=name)


def _alone(rank: int, world: int) -> dict:
    net = _two_linears()

    def loss_of(engine, rank, step):
        if step == 0:
            engine(torch.zeros(1, 4))  # a first pass through the root gathers the persistent params
        return engine.module[0](_input(rank, step)).square().sum()
    return _trained(net, rank, loss_of, bare=True)


def test_an_inert_module_called_on_its_own_trains_as_plain_torch():
    """[Note: persistent grads at the end of backward] (fz3/core/calls.py): its params have no
    grad hook and its call no autograd node of its own; as the outermost call it gets one, so
    even a bare loss.backward() reports its grads. Without it nothing is reduced, and no step is
    taken."""
    _as_plain_torch(_alone)


def _inner(rank: int, world: int, bare: bool = False, gas: int = 1) -> dict:
    net, seen = _two_linears(), []
    net[0].register_forward_hook(lambda module, args, out: seen.append(out))

    def loss_of(engine, rank, step):
        seen.clear()
        engine(_input(rank, step))
        return seen[0].square().sum()  # from inside: no fz3 node, no hooked param on the way
    return _trained(net, rank, loss_of, bare, gas)


@pytest.mark.parametrize("bare, gas", [(False, 1), (True, 1), (True, 2)],
                         ids=["engine.backward", "bare, then step", "bare, 2 micro-steps, step at the boundary"])
def test_a_backward_from_an_inner_inert_output_is_reduced(bare, gas):
    """[Note: persistent grads at the end of backward]: the backward meets no fz3 node and no
    hooked param, so no end is queued; the engine reports the grads left in .grad after
    engine.backward, or, after a bare loss.backward(), at step() (the micro-step of gas 2 off
    the boundary too: its grads join the window there) or at the next outermost call's
    pre-forward."""
    _as_plain_torch(lambda rank, world: _inner(rank, world, bare, gas), gas)
