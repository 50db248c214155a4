"""What a module call costs the shell (issue #27 point 4): the events it sends and the walks of
its tensors, counted on thread ranks.

  - a module reading its own params sends no Read (the core would do nothing with it:
    fz3.core.calls.running); a module reading another's (nn.MultiheadAttention reads
    out_proj.weight without calling out_proj) still does, and borrows it
  - a call's inputs and outputs are each walked once (flatten), where the pre-forward, the
    inputs' wrap and the outputs' wrap each walked them again; an inert call's inputs (its
    params persistent: no autograd node) are not walked at all, and one inside another call
    takes no event
  - what autograd saves is watched only where a pass frees params (fz3.core.calls.saves_matter)
"""
from __future__ import annotations

import collections

import torch
from torch import nn

import fz3
from fz3 import launch
import fz3.shell.engine as engine_module


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.mha = nn.MultiheadAttention(6, 2, batch_first=True)

    def forward(self, x):
        h = self.b(torch.relu(self.a(x)))
        return self.mha(h, h, h, need_weights=False)[0]


def _count(rank: int, world: int, threshold: int) -> dict:
    torch.manual_seed(0)
    model = Net()
    engine = fz3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            fz3.Config(param_persistence_threshold=threshold))
    x = torch.randn(2, 3, 6, generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        engine.backward(engine(x).square().mean())
        engine.step()
    events, walks, door, flatten = collections.Counter(), collections.Counter(), engine.update, engine_module.flatten

    def counting(cell, e, *, config):
        events[type(e).__name__] += 1
        return door(cell, e, config=config)

    def walking(tree):
        walks["flatten"] += 1
        return flatten(tree)
    pack = engine.saved.pack

    def packing(t):
        walks["pack"] += 1
        return pack(t)
    engine.update = counting
    engine.saved.pack = packing  # taken when the next pass opens the saved-tensor hooks
    engine_module.flatten = walking
    try:
        engine.backward(engine(x).square().mean())
        engine.step()
    finally:
        engine_module.flatten = flatten
    names = engine.tables.module_names
    return {"events": dict(events), "walks": walks["flatten"], "calls": events["Enter"],
            "borrowed": sorted(names[m] for m in range(len(names)) if engine.params_state.externals(m)),
            "inert": sum(engine.call_tables.inert), "packs": walks["pack"]}


def test_own_param_reads_send_no_event_and_borrowed_ones_do():
    for out in launch.run_threads(_count, 2, args=(0,)):
        # every module reads its own params (a.weight, a.bias, ... 8 reads): none is an event;
        # mha reads out_proj's weight and bias without calling out_proj: 2 Reads, borrowed
        assert out["events"]["Read"] == 2, out
        assert out["borrowed"] == ["mha"], out


def test_each_call_walks_its_inputs_and_outputs_once():
    """One rank: the walks are counted on the engine module, which thread ranks share."""
    out = launch.run_threads(_count, 1, args=(0,))[0]  # nothing persistent: no call is inert
    assert out["inert"] == 0 and out["walks"] == 2 * out["calls"], out
    out = launch.run_threads(_count, 1, args=(10**6,))[0]  # every param persistent: a, b, mha and
    # out_proj are inert; called inside the root, they take no event and nothing is walked
    assert out["inert"] == 4 and out["calls"] == 1 and out["walks"] == 2, out


def test_an_inert_call_inside_another_takes_no_event_and_its_params_no_read():
    """[Note: inert modules] (fz3/core/calls.py): every param persistent, the root's is the one
    call the core hears of; mha reads out_proj's params, persistent, and borrows nothing."""
    for out in launch.run_threads(_count, 2, args=(10**6,)):
        assert out["events"] == {"Enter": 1, "Leave": 1, "PreBackwardRan": 1, "BackwardEnded": 1,
                                 "StepCalled": 1, "Stepped": 1}, out
        assert out["borrowed"] == [], out


def test_saves_are_watched_only_where_a_pass_frees_params():
    out = launch.run_threads(_count, 1, args=(0,))[0]
    assert out["packs"] > 0, out
    out = launch.run_threads(_count, 1, args=(10**6,))[0]  # every param persistent: nothing freed
    assert out["packs"] == 0, out
