"""Misuse is a clear error, never silence (issue #10); an exception inside forward leaves the
engine usable.

One 1-rank gloo launch runs every probe (a process start costs seconds); each probe returns the
message it got, or what happened instead, and the tests check the message names the offending
value and what is allowed.
"""
from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from fz3 import launch

pytestmark = pytest.mark.timeout(300)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 6), nn.Linear(6, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.body, self.head = nn.Linear(3, 4), nn.Sequential(Block(), Block()), nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.body(self.inp(x)))


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        return f"{type(e).__name__}: {e}"
    return "no error"


def _probes(rank: int, world_size: int) -> dict:
    import fz3
    torch.manual_seed(0)
    out = {}
    cfg = fz3.Config(param_persistence_threshold=0)

    net = Net()
    engine = fz3.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1), cfg)
    out["twice"] = _error(lambda: fz3.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1), cfg))
    out["twice_sub"] = _error(lambda: fz3.initialize(net.body, torch.optim.SGD(net.body.parameters(), lr=0.1), cfg))
    out["leaf_after"] = _error(lambda: fz3.set_leaf_modules(net, [Block]))
    x = torch.randn(5, 3)
    net.body[0].fc1.weight.requires_grad_(False)
    out["frozen_after"] = _error(lambda: engine(x))
    net.body[0].fc1.weight.requires_grad_(True)
    engine(x).sum().backward()  # flipped back: trains again
    engine.step()

    # an exception inside forward (a shape error in one block, on every rank)
    engine(x).sum().backward()
    engine.step()
    out["raised"] = _error(lambda: engine(torch.randn(5, 7)))
    out["live_after_raise"] = engine.stats()["live_numel"]
    loss = engine(x).sum()
    engine.backward(loss)
    engine.step()
    out["live_after_step"] = engine.stats()["live_numel"]
    out["persistent"] = sum(p.numel for p in engine.spec.params if p.persistent)

    # set_leaf_modules on a submodule is honoured (the module objects are marked)
    net2 = Net()
    out["leaf_marked"] = len(fz3.set_leaf_modules(net2.body, [Block]))
    engine2 = fz3.initialize(net2, torch.optim.SGD(net2.parameters(), lr=0.1), cfg)
    out["leaves"] = [engine2.tables.module_names[m] for m, ms in enumerate(engine2.spec.modules) if ms.is_leaf]

    net3 = Net()
    other = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)
    out["foreign_scheduler"] = _error(lambda: fz3.initialize(
        net3, torch.optim.SGD(net3.parameters(), lr=0.1), cfg, torch.optim.lr_scheduler.StepLR(other, 1)))
    return out


@functools.lru_cache(maxsize=None)
def probes() -> dict:
    return launch.run(_probes, world_size=1, timeout=240)[0]


def test_initialize_twice_is_an_error():
    assert probes()["twice"].startswith("RuntimeError") and "'inp.weight'" in probes()["twice"]
    assert "already has an fz3 engine" in probes()["twice_sub"]


def test_requires_grad_changed_after_initialize_is_an_error_at_the_next_forward():
    msg = probes()["frozen_after"]
    assert msg.startswith("RuntimeError") and "'body.0.fc1.weight' (True -> False)" in msg, msg
    assert "before" in msg  # what to do instead


def test_set_leaf_modules_after_initialize_is_an_error():
    assert probes()["leaf_after"].startswith("RuntimeError") and "before fz3.initialize" in probes()["leaf_after"]


def test_set_leaf_modules_on_a_submodule_is_honoured():
    assert probes()["leaf_marked"] == 2
    assert probes()["leaves"] == ["body.0", "body.1"]


def test_set_leaf_modules_naming_a_class_not_in_the_model():
    import fz3

    class Missing(nn.Module):
        pass

    with pytest.raises(ValueError, match=r"\['Missing'\].*'Block'"):
        fz3.set_leaf_modules(Net(), [Missing])
    with pytest.raises(TypeError, match="nn.Module subclasses"):
        fz3.set_leaf_modules(Net(), [int])


def test_scheduler_of_another_optimizer_is_an_error():
    assert probes()["foreign_scheduler"].startswith("ValueError") and "StepLR" in probes()["foreign_scheduler"]


def test_an_exception_inside_forward_leaves_the_engine_usable():
    """The failed pass's gathers are freed by the next pass; after its step only the persistent
    params are live (none here). Parity after such a pass: every model of the parity suite."""
    out = probes()
    assert "RuntimeError" in out["raised"], out["raised"]
    assert out["live_after_step"] == out["persistent"] == 0, out
