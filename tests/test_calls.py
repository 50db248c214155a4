"""fz3/core/calls.py event by event, on small hand-built models: the decisions the shell's hooks
used to make (the calls machine, property_tests/test_calls_machine.py, drives them on drawn
programs)."""
from __future__ import annotations

import pytest

from fz3.core import calls
from fz3.core.config import Config
from fz3.core.effects import AllGather, Free
from fz3.core.grads import init_grad_state
from fz3.core.hook_effects import (BeginPass, EndPass, GradDue, QueueEndOfBackward, WrapInputs,
                                   WrapOutputs, ZeroGrads)
from fz3.core.pvec import Log
from fz3.core.spec import build_spec
from fz3.core.state import initial_state

CFG = Config(param_persistence_threshold=2)


def lifecycle(params, modules, trainable=None):
    spec = build_spec(params, modules, world_size=2, persistence_threshold=CFG.param_persistence_threshold)
    trainable = trainable or [True] * len(params)
    return calls.Lifecycle(initial_state(spec), init_grad_state(spec), calls.initial_calls(spec, trainable))


# root; emb (w 8); norm (g 2: persistent -> inert); moe leaf (e 8); lin (e tied, v 8)
MODEL = ([("w", 8), ("g", 2), ("e", 8), ("v", 8)],
         [("", [], False), ("emb", [0], False), ("norm", [1], False), ("moe", [2], True), ("lin", [3], False)])


def test_tables_inert_grad_params_and_hooks():
    t = lifecycle(*MODEL).calls.tables
    assert t.inert == (False, False, True, False, False)  # the root and leaves never are
    assert t.grad_params == ((), (0,), (), (), (3,))
    assert t.hooked == (True, True, False, True)  # e: the leaf's own, reduced with it


def test_a_tied_leaf_param_gets_a_hook():
    params, modules = MODEL
    modules = modules[:4] + [("lin", [2, 3], False)]
    assert lifecycle(params, modules).calls.tables.hooked == (True, True, True, True)


def test_enter_wraps_inputs_or_waits_and_leave_wraps_outputs():
    st = lifecycle(*MODEL)
    st, eff = calls.enter(st, 0, config=CFG, grad=True, grad_inputs=False, saved=0)
    assert BeginPass() in eff and not any(isinstance(e, WrapInputs) for e in eff)
    st, eff = calls.enter(st, 1, config=CFG, grad=True, grad_inputs=False, saved=0)  # ids: waits
    assert [w.module for w in st.calls.waiting] == [1]
    st, eff = calls.leave(st, 1, config=CFG, grad_outputs=True, saved=Log([0]))  # saved w: reads it
    assert WrapOutputs(1) in eff and st.calls.waiting
    st, eff = calls.enter(st, 2, config=CFG, grad=True, grad_inputs=True)  # inert: no node
    assert WrapInputs(2) not in eff
    st, eff = calls.leave(st, 2, config=CFG, grad_outputs=True)
    assert WrapOutputs(2) not in eff
    st, eff = calls.enter(st, 4, config=CFG, grad=True, grad_inputs=True)
    assert WrapInputs(4) in eff
    st, eff = calls.leave(st, 4, config=CFG, grad_outputs=True)
    st, eff = calls.leave(st, 0, config=CFG, grad_outputs=True)
    assert EndPass() in eff and not st.calls.stack


def test_a_waiting_call_that_saved_none_of_its_params_is_over_at_its_forward():
    st = lifecycle(*MODEL)
    st, _ = calls.enter(st, 0, config=CFG, grad=True, grad_inputs=False, saved=0)
    st, _ = calls.enter(st, 1, config=CFG, grad=True, grad_inputs=False, saved=0)
    st, eff = calls.leave(st, 1, config=CFG, grad_outputs=True, saved=Log())
    assert GradDue((0,)) in eff and Free((0,)) in eff and WrapOutputs(1) not in eff
    assert not st.calls.waiting


def forward_through_lin(st):
    """One forward with grad: the root, which calls lin."""
    st, _ = calls.enter(st, 0, config=CFG, grad=True, grad_inputs=True)
    st, _ = calls.enter(st, 4, config=CFG, grad=True, grad_inputs=True)
    st, _ = calls.leave(st, 4, config=CFG, grad_outputs=True)
    st, _ = calls.leave(st, 0, config=CFG, grad_outputs=True)
    return st


def test_end_of_backward_is_queued_once_per_backward():
    st = forward_through_lin(lifecycle(*MODEL))
    st, eff = calls.pre_backward(st, 0, config=CFG)
    assert eff == (QueueEndOfBackward(),)
    st, eff = calls.pre_backward(st, 4, config=CFG)
    assert QueueEndOfBackward() not in eff and any(isinstance(e, AllGather) for e in eff)
    st, _ = calls.end_of_backward(st, config=CFG)
    st, eff = calls.enter(st, 0, config=CFG, grad=True, grad_inputs=True)
    assert not st.calls.backward


def test_a_leaf_is_reduced_once_all_its_calls_backward_is_done():
    """Called twice, first on an input that needs no grad: its later call's post_backward may
    not reduce it (the earlier call's backward still adds to e); the end of backward does."""
    st = lifecycle(*MODEL)
    st, _ = calls.enter(st, 0, config=CFG, grad=True, grad_inputs=True)
    st, _ = calls.enter(st, 3, config=CFG, grad=True, grad_inputs=False)
    st, _ = calls.leave(st, 3, config=CFG, grad_outputs=True)
    st, _ = calls.enter(st, 3, config=CFG, grad=True, grad_inputs=True)
    st, _ = calls.leave(st, 3, config=CFG, grad_outputs=True)
    st, _ = calls.leave(st, 0, config=CFG, grad_outputs=True)
    st, _ = calls.pre_backward(st, 0, config=CFG)
    st, _ = calls.pre_backward(st, 3, config=CFG)
    st, eff = calls.post_backward(st, 3, config=CFG)
    assert ZeroGrads((2,)) not in eff
    st, _ = calls.pre_backward(st, 3, config=CFG)
    st, eff = calls.end_of_backward(st, config=CFG)
    assert eff.index(ZeroGrads((2,))) < len(eff)


def test_borrowing_a_leafs_own_param_with_grad_is_refused_naming_it():
    st = lifecycle(*MODEL)
    st, _ = calls.enter(st, 0, config=CFG, grad=True, grad_inputs=True)
    st, _ = calls.enter(st, 4, config=CFG, grad=True, grad_inputs=True)
    with pytest.raises(ValueError, match=r"param 'e' belongs to the leaf module 'moe' only, and module 'lin' uses it \(reads it\)"):
        calls.read(st, 3, 2, config=CFG)
    same, eff = calls.read(st, 3, 2, config=CFG, grad=False)  # no grad: borrowed as any param
    assert 2 in same.params.module_rows[4][-1]


def test_a_leaf_whose_call_needs_no_grad_gets_zero_grads_of_its_params_shape():
    """Every row goes to a frozen expert: the leaf's call needs no grad, so its trainable params
    get no grad from autograd and the core zero-fills them (ZeroGrads) while they are freed; the
    engine once gave them empty grads (found by property_tests/test_interpreters_differential.py)."""
    import torch
    from torch import nn

    import fz3
    from fz3 import launch
    from fz3.testing.drawn_nets import Experts

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.experts, self.head = Experts(3), nn.Linear(3, 1)

        def forward(self, x):
            return self.head(self.experts(x))

    def train(rank, world, contiguous):
        net = Net()
        net.experts.experts[1].requires_grad_(False)
        fz3.set_leaf_modules(net, [Experts])
        before = net.experts.experts[0].weight.detach().clone()
        engine = fz3.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1),
                                fz3.Config(param_persistence_threshold=0, contiguous_gradients=contiguous))
        engine.backward(engine(torch.tensor([[-1., 1, 1], [0., 1, 0]])).sum())  # first feature <= 0
        engine.step()
        return torch.equal(engine.full_state_dict()["experts.experts.0.weight"], before)

    for world in (1, 2):
        for contiguous in (True, False):
            assert launch.run_threads(train, world, args=(contiguous,), timeout_s=60) == [True] * world


def test_a_backward_that_never_ended_does_not_silence_the_next_one():
    """A backward that raised never runs its queued end; the next pass's backward must queue its
    own (else no epilogue would ever run again: no reduce, no optimizer step)."""
    st = forward_through_lin(lifecycle(*MODEL))
    st, eff = calls.pre_backward(st, 0, config=CFG)
    assert QueueEndOfBackward() in eff  # ... and the backward raises before its end
    st, _ = calls.enter(st, 0, config=CFG, grad=True, grad_inputs=True)
    st, _ = calls.leave(st, 0, config=CFG, grad_outputs=True)
    st, eff = calls.pre_backward(st, 0, config=CFG)
    assert QueueEndOfBackward() in eff
