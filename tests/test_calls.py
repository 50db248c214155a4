"""fz3/core/calls.py event by event, on small hand-built models: the decisions the shell's hooks
used to make (the calls machine, property_tests/test_calls_machine.py, drives them on drawn
programs)."""
from __future__ import annotations

import pytest

from fz3.core import calls
from fz3.core.events import (BackwardEnded, Enter, GradReady, GradsZeroed, Leave, PostBackwardRan, PreBackwardRan,
                             Raised, Read, StepCalled, Stepped, Unhold)
from fz3.config.config import Config
from fz3.core.effects import AllGather, CopyToBucket, Free, FreePartitions
from fz3.core.grad.grads import init_grad_state
from fz3.core.hook_effects import (BeginPass, ClearGradDue, EndOfBackward, EndPass, GradDue, GradIn,
                                   QueueEndOfBackward, SkipStep, StepOptimizer, WrapInputs, WrapOutputs,
                                   ZeroGrads)
from fz3.core.ids import Status, TraceMode
from fz3.core.pvec import Log
from fz3.core.spec import build_spec
from fz3.core.param.state import initial_state

CFG = Config(param_persistence_threshold=2)


def stepped(st, **kw):
    """The engine's step() at the boundary: StepCalled closes the window, then Stepped."""
    st, _ = calls.step_called(st, StepCalled(), config=CFG)
    return calls.stepped(st, Stepped(**kw), config=CFG)


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
    # g: persistent, norm's alone, reported at the end of backward; e: the leaf's own, reduced with it
    assert t.hooked == (True, False, False, True)
    assert t.at_end == (1,) and t.leaf_own == (2,)


def test_a_tied_leaf_param_gets_a_hook():
    params, modules = MODEL
    modules = modules[:4] + [("lin", [2, 3], False)]
    assert lifecycle(params, modules).calls.tables.hooked == (True, False, True, True)


def test_a_tied_persistent_param_gets_a_hook_and_a_frozen_one_is_not_reported():
    params, modules = MODEL
    tied = modules[:1] + [("emb", [0, 1], False)] + modules[2:]
    t = lifecycle(params, tied).calls.tables
    assert t.hooked == (True, True, False, True) and t.at_end == ()
    assert t.grad_params[1] == (0, 1)  # g has a hook: emb's call may wait for it
    t = lifecycle(*MODEL, trainable=[True, False, True, True]).calls.tables
    assert t.hooked == (True, False, False, True) and t.at_end == ()


def test_persistent_grads_are_reported_at_the_end_of_backward_only_if_they_came():
    """[Note: persistent grads at the end of backward] g got a grad: bucketed, got in the
    window, like a hooked param; no grad: not reported, no zeros stand in (a grad on another
    rank only is a reduce this one does not issue: the divergence check names it)."""
    for with_grad, reported in ((frozenset({1}), True), (frozenset(), False)):
        st = lifecycle(*MODEL)
        st, _ = calls.enter(st, Enter(module=0, grad=True, grad_inputs=False, saved=0), config=CFG)
        st, _ = calls.leave(st, Leave(module=0, grad_outputs=True), config=CFG)
        st, _ = calls.pre_backward(st, PreBackwardRan(module=0), config=CFG)
        b = st.grads.backward
        st, eff = calls.end_of_backward(st, BackwardEnded(with_grad=with_grad), config=CFG)
        pg = st.grads.params[1]
        assert (pg.reported == b) is reported and (pg.got == st.grads.window) is reported, with_grad
        assert not any(isinstance(e, ZeroGrads) for e in eff)
        assert any(isinstance(e, CopyToBucket) and e.param == 1 for e in eff) is reported, eff
        st, eff = stepped(st)
        assert (1 in eff[0].no_grad) is not reported


def test_the_outermost_call_gets_a_pre_backward_node_even_when_inert():
    """A backward through an inert module called on its own still queues its end, which
    reports its persistent grads."""
    st = lifecycle(*MODEL)
    st, eff = calls.enter(st, Enter(module=2, grad=True, grad_inputs=True), config=CFG)
    assert WrapInputs(2) not in eff
    st, eff = calls.leave(st, Leave(module=2, grad_outputs=True), config=CFG)
    assert WrapOutputs(2) in eff
    st, eff = calls.pre_backward(st, PreBackwardRan(module=2), config=CFG)
    assert QueueEndOfBackward() in eff


def test_enter_wraps_inputs_or_waits_and_leave_wraps_outputs():
    st = lifecycle(*MODEL)
    st, eff = calls.enter(st, Enter(module=0, grad=True, grad_inputs=False, saved=0), config=CFG)
    assert BeginPass() in eff and not any(isinstance(e, WrapInputs) for e in eff)
    st, eff = calls.enter(st, Enter(module=1, grad=True, grad_inputs=False, saved=0), config=CFG)  # ids: waits
    assert [w.module for w in st.calls.waiting] == [1]
    st, eff = calls.leave(st, Leave(module=1, grad_outputs=True, saved=Log([0])), config=CFG)  # saved w: reads it
    assert WrapOutputs(1) in eff and st.calls.waiting
    st, eff = calls.enter(st, Enter(module=2, grad=True, grad_inputs=True), config=CFG)  # inert: no node
    assert WrapInputs(2) not in eff
    st, eff = calls.leave(st, Leave(module=2, grad_outputs=True), config=CFG)
    assert WrapOutputs(2) not in eff
    st, eff = calls.enter(st, Enter(module=4, grad=True, grad_inputs=True), config=CFG)
    # lin's own params are all trainable: released by its grads, no node ([Note: released by its grads])
    assert WrapInputs(4) not in eff and [w.module for w in st.calls.waiting] == [1, 4]
    st, eff = calls.leave(st, Leave(module=4, grad_outputs=True), config=CFG)
    st, eff = calls.leave(st, Leave(module=0, grad_outputs=True), config=CFG)
    assert EndPass() in eff and not st.calls.stack


def test_a_call_with_grad_inputs_is_released_by_its_grads_unless_a_param_is_frozen():
    """[Note: released by its grads] lin (v) with grad inputs waits for v's grad and is
    released at it, with no PostBackward node; with v frozen it gets the node, and is released
    at its post-backward."""
    st = forward_through_lin(lifecycle(*MODEL))
    assert st.calls.tables.by_grads == (False, True, False, False, True)
    assert [w.module for w in st.calls.waiting] == [4]
    st, _ = calls.pre_backward(st, PreBackwardRan(module=0), config=CFG)
    st, _ = calls.pre_backward(st, PreBackwardRan(module=4), config=CFG)
    assert st.params.status(3) == Status.AVAILABLE
    st, eff = calls.grad_ready(st, GradReady(param=3, dtype="float32"), config=CFG)
    assert any(isinstance(e, Free) and 3 in e.params for e in eff) and not st.calls.waiting

    st = lifecycle(*MODEL, trainable=[True, True, True, False])
    assert not st.calls.tables.by_grads[4]
    st, _ = calls.enter(st, Enter(module=0, grad=True, grad_inputs=True), config=CFG)
    st, eff = calls.enter(st, Enter(module=4, grad=True, grad_inputs=True), config=CFG)
    assert WrapInputs(4) in eff and not st.calls.waiting


def test_only_the_first_call_with_grad_of_a_module_in_a_pass_is_released_by_its_grads():
    """[Note: released by its grads] lin applied twice (ALBERT): v's grad comes after both
    calls' backwards, so the second call gets its node and releases what it fetched at its own
    backward ([Note: release per call]); the first waits, its backward the last. The next pass
    (and the next backward) starts over."""
    st = lifecycle(*MODEL)
    for _ in range(2):
        st, _ = calls.enter(st, Enter(module=0, grad=True, grad_inputs=True), config=CFG)
        st, eff = calls.enter(st, Enter(module=4, grad=True, grad_inputs=True), config=CFG)
        assert WrapInputs(4) not in eff
        st, _ = calls.leave(st, Leave(module=4, grad_outputs=True), config=CFG)
        st, eff = calls.enter(st, Enter(module=4, grad=True, grad_inputs=True), config=CFG)
        assert WrapInputs(4) in eff and st.params.grads_remaining(4) == 2
        st, _ = calls.leave(st, Leave(module=4, grad_outputs=True), config=CFG)
        st, _ = calls.leave(st, Leave(module=0, grad_outputs=True), config=CFG)
        for m in (0, 4):
            st, _ = calls.pre_backward(st, PreBackwardRan(module=m), config=CFG)
        st, eff = calls.post_backward(st, PostBackwardRan(module=4), config=CFG)  # the second call's
        assert st.params.grads_remaining(4) == 1
        st, _ = calls.pre_backward(st, PreBackwardRan(module=4), config=CFG)
        st, eff = calls.grad_ready(st, GradReady(param=3, dtype="float32"), config=CFG)
        assert any(isinstance(e, Free) and 3 in e.params for e in eff) and st.params.grads_remaining(4) == 0
        st, _ = calls.end_of_backward(st, BackwardEnded(), config=CFG)
        st, _ = stepped(st)


def test_a_call_holding_a_param_another_module_uses_gets_its_post_backward_node():
    """[Note: released by its grads] A tied param's grad comes once every module using it is
    done (a tied lm_head's weight: at the token embedding's grad, the end of backward), and so
    does a borrowed one's: a call waiting for it would hold its unit that long. Tied (lin holds
    e too, the leaf's): lin's calls get the node. Borrowed (the root reads emb's w): emb's next
    call does."""
    params, modules = MODEL
    st = lifecycle(params, modules[:4] + [("lin", [2, 3], False)])
    assert not st.calls.tables.by_grads[4]
    st, _ = calls.enter(st, Enter(module=0, grad=True, grad_inputs=True), config=CFG)
    st, eff = calls.enter(st, Enter(module=4, grad=True, grad_inputs=True), config=CFG)
    assert WrapInputs(4) in eff

    st = lifecycle(*MODEL)
    st, _ = calls.enter(st, Enter(module=0, grad=True, grad_inputs=True), config=CFG)
    st, eff = calls.enter(st, Enter(module=1, grad=True, grad_inputs=True), config=CFG)
    assert WrapInputs(1) not in eff  # nobody borrows w yet
    st, _ = calls.leave(st, Leave(module=1, grad_outputs=True), config=CFG)
    st, _ = calls.read(st, Read(owner=1, param=0, grad=True), config=CFG)  # the root reads emb's w
    assert st.params.is_external(0)
    st, eff = calls.enter(st, Enter(module=1, grad=True, grad_inputs=True), config=CFG)
    assert WrapInputs(1) in eff


def test_a_waiting_call_that_saved_none_of_its_params_is_over_at_its_forward():
    st = lifecycle(*MODEL)
    st, _ = calls.enter(st, Enter(module=0, grad=True, grad_inputs=False, saved=0), config=CFG)
    st, _ = calls.enter(st, Enter(module=1, grad=True, grad_inputs=False, saved=0), config=CFG)
    st, eff = calls.leave(st, Leave(module=1, grad_outputs=True, saved=Log()), config=CFG)
    assert GradDue((0,)) in eff and Free((0,)) in eff and WrapOutputs(1) not in eff
    assert not st.calls.waiting


def forward_through(st, m, grad_outputs=True):
    """One forward with grad inputs: the root, which calls module m once."""
    st, _ = calls.enter(st, Enter(module=0, grad=True, grad_inputs=True), config=CFG)
    st, _ = calls.enter(st, Enter(module=m, grad=True, grad_inputs=True), config=CFG)
    st, _ = calls.leave(st, Leave(module=m, grad_outputs=grad_outputs), config=CFG)
    st, _ = calls.leave(st, Leave(module=0, grad_outputs=grad_outputs), config=CFG)
    return st


def forward_through_lin(st):
    """One forward with grad: the root, which calls lin."""
    return forward_through(st, 4)


def test_end_of_backward_is_queued_once_per_backward():
    st = forward_through_lin(lifecycle(*MODEL))
    st, eff = calls.pre_backward(st, PreBackwardRan(module=0), config=CFG)
    assert eff == (QueueEndOfBackward(),)
    st, eff = calls.pre_backward(st, PreBackwardRan(module=4), config=CFG)
    assert QueueEndOfBackward() not in eff and any(isinstance(e, AllGather) for e in eff)
    st, _ = calls.end_of_backward(st, BackwardEnded(), config=CFG)
    st, eff = calls.enter(st, Enter(module=0, grad=True, grad_inputs=True), config=CFG)
    assert not st.calls.backward


def test_a_leaf_is_reduced_once_all_its_calls_backward_is_done():
    """Called twice, first on an input that needs no grad: its later call's post_backward may
    not reduce it (the earlier call's backward still adds to e); the end of backward does."""
    st = lifecycle(*MODEL)
    st, _ = calls.enter(st, Enter(module=0, grad=True, grad_inputs=True), config=CFG)
    st, _ = calls.enter(st, Enter(module=3, grad=True, grad_inputs=False), config=CFG)
    st, _ = calls.leave(st, Leave(module=3, grad_outputs=True), config=CFG)
    st, _ = calls.enter(st, Enter(module=3, grad=True, grad_inputs=True), config=CFG)
    st, _ = calls.leave(st, Leave(module=3, grad_outputs=True), config=CFG)
    st, _ = calls.leave(st, Leave(module=0, grad_outputs=True), config=CFG)
    st, _ = calls.pre_backward(st, PreBackwardRan(module=0), config=CFG)
    st, _ = calls.pre_backward(st, PreBackwardRan(module=3), config=CFG)
    st, eff = calls.post_backward(st, PostBackwardRan(module=3), config=CFG)
    assert ZeroGrads((2,)) not in eff
    st, _ = calls.pre_backward(st, PreBackwardRan(module=3), config=CFG)
    st, eff = calls.end_of_backward(st, BackwardEnded(), config=CFG)
    assert eff.index(ZeroGrads((2,))) < len(eff)


def test_borrowing_a_leafs_own_param_with_grad_is_refused_naming_it():
    st = lifecycle(*MODEL)
    st, _ = calls.enter(st, Enter(module=0, grad=True, grad_inputs=True), config=CFG)
    st, _ = calls.enter(st, Enter(module=4, grad=True, grad_inputs=True), config=CFG)
    with pytest.raises(ValueError, match=r"param 'e' belongs to the leaf module 'moe' only, and module 'lin' uses it \(reads it\)"):
        calls.read(st, Read(owner=3, param=2), config=CFG)
    same, eff = calls.read(st, Read(owner=3, param=2, grad=False), config=CFG)  # no grad: borrowed as any param
    assert 2 in same.params.externals(4)


def test_a_leaf_whose_call_needs_no_grad_gets_zero_grads_of_its_params_shape():
    """Every row goes to a frozen expert: the leaf's call needs no grad, so its trainable params
    get no grad from autograd and the core zero-fills them (ZeroGrads) while they are freed; the
    engine once gave them empty grads (found by property_tests/test_interpreters_differential.py)."""
    import torch
    from torch import nn

    import fz3
    from fz3 import launch
    from tests.support.drawn_nets import Experts

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
    st, eff = calls.pre_backward(st, PreBackwardRan(module=0), config=CFG)
    assert QueueEndOfBackward() in eff  # ... and the backward raises before its end
    st, _ = calls.enter(st, Enter(module=0, grad=True, grad_inputs=True), config=CFG)
    st, _ = calls.leave(st, Leave(module=0, grad_outputs=True), config=CFG)
    st, eff = calls.pre_backward(st, PreBackwardRan(module=0), config=CFG)
    assert QueueEndOfBackward() in eff


# ---- tables and the initial state ------------------------------------------------------------------

def test_tables_waiters_map_each_grad_param_to_the_modules_it_ends():
    """`waiters`: a param -> every module with it in grad_params, in module order (a tied
    param ends the waiting calls of each of its modules); leaves and inert modules wait on none."""
    assert lifecycle(*MODEL).calls.tables.waiters == {0: (1,), 3: (4,)}
    params, modules = MODEL
    tied = modules[:4] + [("lin", [0, 3], False)]
    assert lifecycle(params, tied).calls.tables.waiters == {0: (1, 4), 3: (4,)}


def test_the_initial_call_state_has_nothing_open_waiting_or_running():
    """Before any pass: no call open, no pass cut short, no waiting call, no leaf to reduce, no
    backward running; and a submodule called on its own (outside the root's forward) runs."""
    c = lifecycle(*MODEL).calls
    assert c.stack == () and not c.aborted and c.waiting == () and c.leaves == frozenset()
    assert not c.backward
    st = lifecycle(*MODEL)
    st, _ = calls.enter(st, Enter(module=1, grad=True, grad_inputs=False, saved=0), config=CFG)  # waits
    assert [f.module for f in st.calls.stack] == [1]
    assert st.calls.waiting == (calls.Waiting(1, 1, frozenset({0})),)
    st, eff = calls.pre_backward(st, PreBackwardRan(module=1), config=CFG)
    assert eff[0] == QueueEndOfBackward()


# ---- waiting calls ([Note: modules without grad inputs]) -----------------------------------------

def test_a_module_called_twice_without_grad_inputs_ends_both_calls_at_its_grad():
    """Two calls of emb on ids: one Waiting entry counting 2 calls (not two entries); the grad of
    w ends both (a post_backward each), even the one whose outputs needed no grad and so got no
    pre_backward: its release is the one that frees w."""
    st = lifecycle(*MODEL)
    st, _ = calls.enter(st, Enter(module=0, grad=True, grad_inputs=False, saved=0), config=CFG)
    st, _ = calls.enter(st, Enter(module=1, grad=True, grad_inputs=False, saved=0), config=CFG)
    st, _ = calls.leave(st, Leave(module=1, grad_outputs=True, saved=Log([0])), config=CFG)
    st, _ = calls.enter(st, Enter(module=1, grad=True, grad_inputs=False, saved=1), config=CFG)
    assert st.calls.waiting == (calls.Waiting(1, 2, frozenset({0})),)
    assert st.params.modules[1].grads_remaining == 2
    st, _ = calls.leave(st, Leave(module=1, grad_outputs=False), config=CFG)  # returns indices: no grad
    st, _ = calls.leave(st, Leave(module=0, grad_outputs=True), config=CFG)
    st, _ = calls.pre_backward(st, PreBackwardRan(module=0), config=CFG)
    st, _ = calls.pre_backward(st, PreBackwardRan(module=1), config=CFG)
    st, eff = calls.grad_ready(st, GradReady(param=0, dtype="float32"), config=CFG)
    assert Free((0,)) in eff and eff[-1] == GradIn(0)
    assert st.calls.waiting == () and st.params.modules[1].grads_remaining == 0
    assert st.params.params[0].status == Status.NOT_AVAILABLE


def emb_then_lin_waiting():
    """Inside a root call without grad inputs: emb (1) then lin (4) called without grad inputs,
    each saving its param; both wait."""
    st = lifecycle(*MODEL)
    st, _ = calls.enter(st, Enter(module=0, grad=True, grad_inputs=False, saved=0), config=CFG)
    st, _ = calls.enter(st, Enter(module=1, grad=True, grad_inputs=False, saved=0), config=CFG)
    st, _ = calls.leave(st, Leave(module=1, grad_outputs=True, saved=Log([0])), config=CFG)
    st, _ = calls.enter(st, Enter(module=4, grad=True, grad_inputs=False, saved=1), config=CFG)
    st, _ = calls.leave(st, Leave(module=4, grad_outputs=True, saved=Log([0, 3])), config=CFG)
    return st


@pytest.mark.parametrize("first", [0, 3])
def test_waiting_modules_end_apart_each_at_its_own_grad(first):
    """emb and lin both called without grad inputs: one Waiting entry each, in call order; the
    grad of one param ends its module's calls only, whichever comes first, and the other entry
    stays as it was."""
    st = emb_then_lin_waiting()
    st, _ = calls.leave(st, Leave(module=0, grad_outputs=True), config=CFG)
    emb, lin = calls.Waiting(1, 1, frozenset({0})), calls.Waiting(4, 1, frozenset({3}))
    assert st.calls.waiting == (emb, lin)
    for m in (0, 4, 1):
        st, _ = calls.pre_backward(st, PreBackwardRan(module=m), config=CFG)
    second = 3 if first == 0 else 0
    st, eff = calls.grad_ready(st, GradReady(param=first, dtype="float32"), config=CFG)
    assert Free((first,)) in eff
    assert st.calls.waiting == ((lin,) if first == 0 else (emb,))
    st, eff = calls.grad_ready(st, GradReady(param=second, dtype="float32"), config=CFG)
    assert Free((second,)) in eff and st.calls.waiting == ()


def test_a_call_that_reads_none_of_its_params_ends_one_waiting_call_and_keeps_the_rest():
    """emb called twice without grad inputs, the second call saving none of w: that call's
    backward is over at its post-forward, so emb waits for one call less, and lin's entry (after
    it in the tuple) stays; emb's remaining call still ends at w's grad."""
    st = emb_then_lin_waiting()
    st, _ = calls.enter(st, Enter(module=1, grad=True, grad_inputs=False, saved=2), config=CFG)
    st, eff = calls.leave(st, Leave(module=1, grad_outputs=True, saved=Log([0, 3])), config=CFG)
    assert GradDue((0,)) in eff and WrapOutputs(1) not in eff
    assert st.calls.waiting == (calls.Waiting(1, 1, frozenset({0})), calls.Waiting(4, 1, frozenset({3})))
    assert st.params.modules[1].grads_remaining == 1
    st, _ = calls.leave(st, Leave(module=0, grad_outputs=True), config=CFG)
    for m in (0, 4, 1):
        st, _ = calls.pre_backward(st, PreBackwardRan(module=m), config=CFG)
    st, eff = calls.grad_ready(st, GradReady(param=0, dtype="float32"), config=CFG)
    assert Free((0,)) in eff and st.calls.waiting == (calls.Waiting(4, 1, frozenset({3})),)


def test_a_grad_for_a_tied_param_reaches_each_module_waiting_on_it():
    """w tied in a (id 1) and b (id 2), b called first: the waiting tuple is (b, a) while
    waiters[w] is (a, b). w's grad takes w off both entries, each its own: a (waiting on w only)
    ends, b still waits on its other param u, and ends at u's grad."""
    st = lifecycle([("w", 8), ("u", 8)], [("", [], False), ("a", [0], False), ("b", [0, 1], False)])
    st, _ = calls.enter(st, Enter(module=0, grad=True, grad_inputs=False, saved=0), config=CFG)
    st, _ = calls.enter(st, Enter(module=2, grad=True, grad_inputs=False, saved=0), config=CFG)
    st, _ = calls.leave(st, Leave(module=2, grad_outputs=True, saved=Log([0, 1])), config=CFG)
    st, _ = calls.enter(st, Enter(module=1, grad=True, grad_inputs=False, saved=2), config=CFG)
    st, _ = calls.leave(st, Leave(module=1, grad_outputs=True, saved=Log([0, 1, 0])), config=CFG)
    st, _ = calls.leave(st, Leave(module=0, grad_outputs=True), config=CFG)
    assert [w.module for w in st.calls.waiting] == [2, 1]
    for m in (0, 1, 2):
        st, _ = calls.pre_backward(st, PreBackwardRan(module=m), config=CFG)
    st, _ = calls.grad_ready(st, GradReady(param=0, dtype="float32"), config=CFG)
    assert st.calls.waiting == (calls.Waiting(2, 1, frozenset({1})),)
    assert st.params.modules[1].grads_remaining == 0
    st, eff = calls.grad_ready(st, GradReady(param=1, dtype="float32"), config=CFG)
    assert st.calls.waiting == () and Free((0, 1)) in eff


def test_a_waiting_call_ends_at_its_modules_other_call_post_backward_when_that_comes_last():
    """emb called once with grad inputs, once without: w's grad alone does not end the waiting
    call (the other call's backward still reads w); that call's post_backward does, releasing
    both (w freed once both are closed). emb also holds g, frozen, so its call with grad inputs
    gets a PostBackward node ([Note: released by its grads])."""
    params, modules = MODEL
    st = lifecycle(params, [modules[0], ("emb", [0, 1], False)] + modules[2:], trainable=[True, False, True, True])
    st, _ = calls.enter(st, Enter(module=0, grad=True, grad_inputs=True), config=CFG)
    st, _ = calls.enter(st, Enter(module=1, grad=True, grad_inputs=True), config=CFG)
    st, _ = calls.leave(st, Leave(module=1, grad_outputs=True), config=CFG)
    st, _ = calls.enter(st, Enter(module=1, grad=True, grad_inputs=False, saved=0), config=CFG)
    st, _ = calls.leave(st, Leave(module=1, grad_outputs=True, saved=Log([0])), config=CFG)
    st, _ = calls.leave(st, Leave(module=0, grad_outputs=True), config=CFG)
    for m in (0, 1, 1):
        st, _ = calls.pre_backward(st, PreBackwardRan(module=m), config=CFG)
    st, eff = calls.grad_ready(st, GradReady(param=0, dtype="float32"), config=CFG)
    assert not any(isinstance(e, Free) for e in eff)
    assert st.calls.waiting == (calls.Waiting(1, 1, frozenset()),)
    st, eff = calls.post_backward(st, PostBackwardRan(module=1), config=CFG)
    assert Free((0,)) in eff and st.calls.waiting == ()
    assert st.params.modules[1].grads_remaining == 0 and st.params.modules[1].active == 0


def test_both_calls_of_a_module_released_by_its_grads_end_at_its_last_grad():
    """emb (w, trainable) called once with grad inputs, once without: both calls wait for w's
    grad, which torch accumulates once both backwards are done, and both end at it."""
    st = lifecycle(*MODEL)
    st, _ = calls.enter(st, Enter(module=0, grad=True, grad_inputs=True), config=CFG)
    st, eff = calls.enter(st, Enter(module=1, grad=True, grad_inputs=True), config=CFG)
    assert WrapInputs(1) not in eff
    st, _ = calls.leave(st, Leave(module=1, grad_outputs=True), config=CFG)
    st, _ = calls.enter(st, Enter(module=1, grad=True, grad_inputs=False, saved=0), config=CFG)
    st, _ = calls.leave(st, Leave(module=1, grad_outputs=True, saved=Log([0])), config=CFG)
    st, _ = calls.leave(st, Leave(module=0, grad_outputs=True), config=CFG)
    assert st.calls.waiting == (calls.Waiting(1, 2, frozenset({0})),)
    for m in (0, 1, 1):
        st, _ = calls.pre_backward(st, PreBackwardRan(module=m), config=CFG)
    st, eff = calls.grad_ready(st, GradReady(param=0, dtype="float32"), config=CFG)
    assert Free((0,)) in eff and st.calls.waiting == ()
    assert st.params.modules[1].grads_remaining == 0 and st.params.modules[1].active == 0


# ---- a planned pass: releases keep what the plan reuses ------------------------------------------

# root; c (c 8, x 8 frozen, shared); a (w 8, x): c runs with grad inputs, a on ids
SHARED = ([("w", 8), ("x", 8), ("c", 8)],
          [("", [], False), ("c", [2, 1], False), ("a", [0, 1], False)], [True, False, True])


def a_pass(st, *, twice):
    """One step: forward root -> c -> a (-> a again with grad inputs, if `twice`); backward
    root, a (, a), w's grad, [a's post_backward], c; its end; the optimizer step. Returns the
    state and the effects of the event that ends a's waiting call."""
    st, _ = calls.enter(st, Enter(module=0, grad=True, grad_inputs=False, saved=0), config=CFG)
    st, _ = calls.enter(st, Enter(module=1, grad=True, grad_inputs=True), config=CFG)
    st, _ = calls.leave(st, Leave(module=1, grad_outputs=True), config=CFG)
    st, _ = calls.enter(st, Enter(module=2, grad=True, grad_inputs=False, saved=0), config=CFG)
    st, _ = calls.leave(st, Leave(module=2, grad_outputs=True, saved=Log([0])), config=CFG)
    if twice:
        st, _ = calls.enter(st, Enter(module=2, grad=True, grad_inputs=True), config=CFG)
        st, _ = calls.leave(st, Leave(module=2, grad_outputs=True), config=CFG)
    st, _ = calls.leave(st, Leave(module=0, grad_outputs=True), config=CFG)
    for m in (0, 2, 2) if twice else (0, 2):
        st, _ = calls.pre_backward(st, PreBackwardRan(module=m), config=CFG)
    st, ended = calls.grad_ready(st, GradReady(param=0, dtype="float32"), config=CFG)
    if twice:
        st, ended = calls.post_backward(st, PostBackwardRan(module=2), config=CFG)
    assert st.calls.waiting == ()
    st, _ = calls.pre_backward(st, PreBackwardRan(module=1), config=CFG)
    st, _ = calls.grad_ready(st, GradReady(param=2, dtype="float32"), config=CFG)
    st, _ = calls.post_backward(st, PostBackwardRan(module=1), config=CFG)
    st, _ = calls.end_of_backward(st, BackwardEnded(), config=CFG)
    st, _ = stepped(st)
    return st, ended


@pytest.mark.parametrize("twice", [False, True])
def test_a_waiting_call_ended_in_a_planned_pass_keeps_a_param_the_plan_reuses(twice):
    """Second pass, the trace COMPLETE: when a's waiting call ends (at w's grad, or at its other
    call's post_backward) w is freed but the frozen x, which c's backward fetches next, is kept
    (release's reuse rule, bounded by the config's max_live_parameters)."""
    st, ended = a_pass(lifecycle(*SHARED), twice=twice)
    assert Free((0, 1)) in ended  # recording: nothing planned, nothing kept
    st, ended = a_pass(st, twice=twice)
    assert st.params.trace.mode is TraceMode.COMPLETE
    assert Free((0,)) in ended and not any(isinstance(e, Free) and 1 in e.params for e in ended)


def test_a_forward_that_raises_in_a_planned_pass_keeps_a_param_the_plan_reuses():
    """raised releases as leave does: in a COMPLETE pass, lin's v (fetched again by lin's
    backward in the plan) is kept, not freed."""
    st = forward_through_lin(lifecycle(*MODEL))
    for step, event in ((calls.pre_backward, PreBackwardRan(module=0)), (calls.pre_backward, PreBackwardRan(module=4)),
                        (calls.post_backward, PostBackwardRan(module=4)), (calls.post_backward, PostBackwardRan(module=0))):
        st, _ = step(st, event, config=CFG)
    st, _ = calls.end_of_backward(st, BackwardEnded(), config=CFG)
    st, _ = stepped(st)
    st, _ = calls.enter(st, Enter(module=0, grad=True, grad_inputs=True), config=CFG)
    assert st.params.trace.mode is TraceMode.COMPLETE
    st, _ = calls.enter(st, Enter(module=4, grad=True, grad_inputs=True), config=CFG)
    st, eff = calls.raised(st, Raised(module=4), config=CFG)
    assert not any(isinstance(e, Free) for e in eff)
    assert st.params.params[3].status == Status.AVAILABLE and [f.module for f in st.calls.stack] == [0]


# ---- grad_ready and the leaves' reduction ---------------------------------------------------------

def test_grad_ready_first_in_a_backward_queues_its_end_and_buckets_by_dtype_and_task():
    """A grad may be the backward's first event (a loss on a param itself): it queues the end of
    backward before bucketing; the grad goes to the bucket of its own dtype, recorded with its
    graph task (0 unless said)."""
    st = forward_through_lin(lifecycle(*MODEL))
    st, eff = calls.grad_ready(st, GradReady(param=3, dtype="bfloat16", graph_task=3), config=CFG)
    assert eff == (QueueEndOfBackward(), CopyToBucket(0, "bfloat16", 3, 0, 8), GradIn(3))
    assert st.grads.params[3].task == 3
    st, eff = calls.grad_ready(st, GradReady(param=0, dtype="float32"), config=CFG)
    assert eff == (CopyToBucket(1, "float32", 0, 0, 8), GradIn(0))
    assert st.grads.params[0].task == 0


def test_a_leafs_grads_are_bucketed_in_the_compute_dtype():
    """The zeros and grads of a leaf's params are reduced as the compute dtype's (bf16), as every
    grad is."""
    cfg = CFG.replace(compute_dtype="bf16")
    st = lifecycle(*MODEL)
    st, _ = calls.enter(st, Enter(module=0, grad=True, grad_inputs=True), config=cfg)
    st, _ = calls.enter(st, Enter(module=3, grad=True, grad_inputs=False), config=cfg)
    st, _ = calls.leave(st, Leave(module=3, grad_outputs=True), config=cfg)
    st, _ = calls.leave(st, Leave(module=0, grad_outputs=True), config=cfg)
    st, eff = calls.end_of_backward(st, BackwardEnded(), config=cfg)
    assert ZeroGrads((2,)) in eff and CopyToBucket(0, "bfloat16", 2, 0, 8) in eff


def forward_through_moe(grad_outputs: bool):
    """One forward with grad inputs: the root, which calls moe (the leaf) once."""
    return forward_through(lifecycle(*MODEL), 3, grad_outputs=grad_outputs)


def test_a_leaf_called_once_is_reduced_at_its_post_backward():
    """Its only call's post_backward is its last: the leaf is reduced there (GRADS_REMAINING 1
    before it), not again at the end of backward."""
    st = forward_through_moe(grad_outputs=True)
    st, _ = calls.pre_backward(st, PreBackwardRan(module=0), config=CFG)
    st, _ = calls.pre_backward(st, PreBackwardRan(module=3), config=CFG)
    st, eff = calls.post_backward(st, PostBackwardRan(module=3), config=CFG)
    assert ZeroGrads((2,)) in eff and st.calls.leaves == frozenset()
    st, eff = calls.end_of_backward(st, BackwardEnded(), config=CFG)
    assert not any(isinstance(e, ZeroGrads) for e in eff)


def test_a_leaf_called_twice_with_grad_inputs_is_reduced_at_its_second_post_backward():
    """Two calls with grad inputs, both pre_backwards run: the first post_backward (2 grads
    remaining) does not reduce, the second (1 remaining) does."""
    st = lifecycle(*MODEL)
    st, _ = calls.enter(st, Enter(module=0, grad=True, grad_inputs=True), config=CFG)
    for _ in range(2):
        st, _ = calls.enter(st, Enter(module=3, grad=True, grad_inputs=True), config=CFG)
        st, _ = calls.leave(st, Leave(module=3, grad_outputs=True), config=CFG)
    st, _ = calls.leave(st, Leave(module=0, grad_outputs=True), config=CFG)
    for m in (0, 3, 3):
        st, _ = calls.pre_backward(st, PreBackwardRan(module=m), config=CFG)
    st, eff = calls.post_backward(st, PostBackwardRan(module=3), config=CFG)
    assert not any(isinstance(e, ZeroGrads) for e in eff) and st.calls.leaves == {3}
    st, eff = calls.post_backward(st, PostBackwardRan(module=3), config=CFG)
    assert ZeroGrads((2,)) in eff and st.calls.leaves == frozenset()


def test_a_backward_that_starts_at_a_leafs_inputs_queues_its_end_before_reducing_it():
    """None of the leaf's outputs needs grad (a loss taken inside it): its post_backward is the
    backward's first event; it queues the end of backward, then reduces the leaf."""
    st = forward_through_moe(grad_outputs=False)
    st, eff = calls.post_backward(st, PostBackwardRan(module=3), config=CFG)
    assert eff[0] == QueueEndOfBackward() and ZeroGrads((2,)) in eff


def forward_with_a_waiting_lin(leaf_grad_inputs: bool):
    """A forward without grad inputs at the root: lin waits (it saved w), then moe (the leaf) runs."""
    st = lifecycle(*MODEL)
    st, _ = calls.enter(st, Enter(module=0, grad=True, grad_inputs=False, saved=0), config=CFG)
    st, _ = calls.enter(st, Enter(module=1, grad=True, grad_inputs=False, saved=0), config=CFG)
    st, _ = calls.leave(st, Leave(module=1, grad_outputs=True, saved=Log([0])), config=CFG)
    st, _ = calls.enter(st, Enter(module=3, grad=True, grad_inputs=leaf_grad_inputs), config=CFG)
    st, _ = calls.leave(st, Leave(module=3, grad_outputs=True), config=CFG)
    st, _ = calls.leave(st, Leave(module=0, grad_outputs=True), config=CFG)
    return st


def test_end_of_backward_clears_grad_due_reduces_leaves_and_drops_waiting_calls():
    """Effects: ClearGradDue first, the leaves never reduced (called without grad inputs), the
    epilogue, EndOfBackward last; a waiting call whose grad never came is dropped and the
    backward is no longer running."""
    st = forward_with_a_waiting_lin(leaf_grad_inputs=False)
    st, _ = calls.pre_backward(st, PreBackwardRan(module=0), config=CFG)
    assert st.calls.waiting and st.calls.leaves == {3}
    st, eff = calls.end_of_backward(st, BackwardEnded(), config=CFG)
    assert eff[0] == ClearGradDue() and ZeroGrads((2,)) in eff and eff[-1] == EndOfBackward()
    assert st.calls.waiting == () and st.calls.leaves == frozenset() and not st.calls.backward


# ---- enter: a new pass, fetch ---------------------------------------------------------------------

def test_a_new_pass_takes_up_the_trace_of_its_kind():
    """The root's pre-forward resets the step with the pass kind: grad mode and train mode
    (train mode on unless said)."""
    for kw, kind in (({}, "train"), ({"grad": False}, "train_no_grad"), ({"training": False}, "eval")):
        args = {"grad": True, **kw}
        st, _ = calls.enter(lifecycle(*MODEL), Enter(module=0, grad_inputs=False, **args), config=CFG)
        assert st.params.trace.kind == kind, kw


def forward_that_raises(st):
    """A forward with grad that raises in lin: both calls closed by raised."""
    st, _ = calls.enter(st, Enter(module=0, grad=True, grad_inputs=True), config=CFG)
    st, _ = calls.enter(st, Enter(module=4, grad=True, grad_inputs=True), config=CFG)
    st, _ = calls.raised(st, Raised(module=4), config=CFG)
    st, eff = calls.raised(st, Raised(module=0), config=CFG)
    assert eff[-1] == EndPass() and not st.calls.stack
    return st


def test_a_pass_after_one_that_raised_forgets_its_partial_trace():
    """A forward that raised marks the pass aborted; the next root tells reset_step, so the
    partial log is dropped (the trace records again instead of freezing it), and clears the
    mark. A pass that ended normally freezes its log."""
    st = forward_that_raises(lifecycle(*MODEL))
    assert st.calls.aborted
    st, _ = calls.enter(st, Enter(module=0, grad=True, grad_inputs=True), config=CFG)
    assert st.params.trace.mode is TraceMode.RECORD and not st.calls.aborted
    st, _ = calls.enter(forward_through_lin(lifecycle(*MODEL)), Enter(module=0, grad=True, grad_inputs=True),
                        config=CFG)
    assert st.params.trace.mode is TraceMode.COMPLETE and not st.calls.aborted


def test_a_pass_whose_calls_never_closed_is_aborted_and_its_stack_dropped():
    """Calls still open at the next root (their post-forward never ran): that pass is aborted too,
    and the new pass's stack holds only its root."""
    st = lifecycle(*MODEL)
    st, _ = calls.enter(st, Enter(module=0, grad=True, grad_inputs=True), config=CFG)
    st, _ = calls.enter(st, Enter(module=4, grad=True, grad_inputs=True), config=CFG)
    st, _ = calls.enter(st, Enter(module=0, grad=True, grad_inputs=True), config=CFG)
    assert [f.module for f in st.calls.stack] == [0]
    assert st.params.trace.mode is TraceMode.RECORD and not st.calls.aborted


def test_a_recompute_that_raises_does_not_cut_the_pass_short():
    """torch.utils.checkpoint's recompute stops by raising in backward: the call is closed, but
    the pass is not aborted, and the next pass freezes its trace."""
    st = forward_through_lin(lifecycle(*MODEL))
    st, _ = calls.pre_backward(st, PreBackwardRan(module=0), config=CFG)
    st, _ = calls.enter(st, Enter(module=4, grad=True, grad_inputs=True, recomputing=True), config=CFG)
    st, eff = calls.raised(st, Raised(module=4, recomputing=True), config=CFG)
    assert not st.calls.stack and not st.calls.aborted and EndPass() not in eff
    st, _ = calls.enter(st, Enter(module=0, grad=True, grad_inputs=True), config=CFG)
    assert st.params.trace.mode is TraceMode.COMPLETE


def test_a_new_pass_forgets_the_last_passs_waiting_calls_and_leaves():
    """A pass whose backward never came (or never ended): its waiting calls and unreduced leaves
    are not the new pass's."""
    st = forward_with_a_waiting_lin(leaf_grad_inputs=True)
    assert st.calls.waiting and st.calls.leaves
    st, _ = calls.enter(st, Enter(module=0, grad=True, grad_inputs=True), config=CFG)
    assert st.calls.waiting == () and st.calls.leaves == frozenset()


def test_the_outermost_call_gathers_every_persistent_param_and_they_stay_live():
    """[Note: persistent params stay live] The first pass's root enter gathers g (persistent:
    norm's, inert) for no module; a call of norm inside it would need no event. The next passes
    find it live: nothing to gather. A submodule called on its own does the same."""
    st = lifecycle(*MODEL)
    st, eff = calls.enter(st, Enter(module=0, grad=True, grad_inputs=False), config=CFG)
    assert AllGather(0, (1,), False, True) in eff and st.params.status(1) == Status.AVAILABLE
    assert st.params.params[1].users == 0
    st, _ = calls.leave(st, Leave(module=0, grad_outputs=False), config=CFG)
    st, eff = calls.enter(st, Enter(module=0, grad=True, grad_inputs=False), config=CFG)
    assert not any(isinstance(e, AllGather) for e in eff), eff
    st, eff = calls.enter(lifecycle(*MODEL), Enter(module=4, grad=True, grad_inputs=True), config=CFG)
    assert AllGather(0, (1,), False, True) in eff and AllGather(1, (3,), False, True) in eff


def test_a_stale_unhold_inside_a_call_gathers_the_persistent_params_again():
    """gathered_parameters(modifier_rank=...) exited inside a forward frees g; the calls of norm
    still to come in this pass take no event, so it is gathered again at once. Outside every
    call it is left to the next outermost enter."""
    from fz3.core import events as core_events
    from fz3.core.events import Hold, Unhold
    st = lifecycle(*MODEL)
    st, _ = calls.enter(st, Enter(module=0, grad=True, grad_inputs=False), config=CFG)
    st, _ = core_events.update(st, Hold(params=(1,)), config=CFG)
    st, eff = core_events.update(st, Unhold(params=(1,), stale=True), config=CFG)
    assert isinstance(eff[0], Free) and any(isinstance(e, AllGather) and e.params == (1,) for e in eff), eff
    assert st.params.status(1) == Status.AVAILABLE
    st, _ = calls.leave(st, Leave(module=0, grad_outputs=False), config=CFG)
    st, _ = core_events.update(st, Hold(params=(1,)), config=CFG)
    st, eff = core_events.update(st, Unhold(params=(1,), stale=True), config=CFG)
    assert not any(isinstance(e, AllGather) for e in eff) and st.params.status(1) == Status.NOT_AVAILABLE


def test_enter_fetches_for_forward_and_counts_one_grad_input_for_a_wrapped_or_waiting_call():
    """The fetch is a forward one; a call whose inputs are wrapped, or that waits on its grads,
    counts one grad input (GRADS_REMAINING), a call under no_grad none. (lin's v frozen: its
    call is wrapped, [Note: released by its grads].)"""
    st = lifecycle(*MODEL, trainable=[True, True, True, False])
    st, _ = calls.enter(st, Enter(module=0, grad=True, grad_inputs=True), config=CFG)  # gathers g: handle 0
    st, eff = calls.enter(st, Enter(module=4, grad=True, grad_inputs=True), config=CFG)
    assert eff[0] == WrapInputs(4) and AllGather(1, (3,), False, True) in eff
    assert st.params.modules[4].grads_remaining == 1
    st, _ = calls.leave(st, Leave(module=4, grad_outputs=True), config=CFG)
    st, _ = calls.enter(st, Enter(module=1, grad=True, grad_inputs=False, saved=0), config=CFG)
    assert st.params.modules[1].grads_remaining == 1
    st, _ = calls.leave(st, Leave(module=1, grad_outputs=True, saved=Log([0])), config=CFG)
    st, _ = calls.enter(st, Enter(module=1, grad=False, grad_inputs=False), config=CFG)
    assert st.params.modules[1].grads_remaining == 1


# ---- leave, raised, read -------------------------------------------------------------------------

def test_a_param_returned_by_the_root_is_borrowed_by_no_one():
    """The root has no caller: a param among its outputs is registered nowhere."""
    st = lifecycle(*MODEL)
    st, _ = calls.enter(st, Enter(module=0, grad=True, grad_inputs=True), config=CFG)
    st, eff = calls.leave(st, Leave(module=0, grad_outputs=True, returned=(0,)), config=CFG)
    assert eff == (WrapOutputs(0), EndPass()) and st.params.modules[0].externals == ()


def test_a_leafs_own_param_returned_to_a_caller_with_grad_is_refused_naming_both():
    """moe returns e to lin: with grad that is refused, naming the param, the leaf, the caller
    and the module that returned it; without grad e is borrowed by the caller."""
    st = lifecycle(*MODEL)
    st, _ = calls.enter(st, Enter(module=0, grad=True, grad_inputs=True), config=CFG)
    st, _ = calls.enter(st, Enter(module=4, grad=True, grad_inputs=True), config=CFG)
    st, _ = calls.enter(st, Enter(module=3, grad=True, grad_inputs=True), config=CFG)
    with pytest.raises(ValueError, match=r"param 'e' belongs to the leaf module 'moe' only, and "
                                         r"module 'lin' uses it \('moe' returns it\)"):
        calls.leave(st, Leave(module=3, grad_outputs=True, returned=(2,)), config=CFG)
    st, _ = calls.leave(st, Leave(module=3, grad_outputs=False, returned=(2,)), config=CFG)
    assert st.params.modules[4].externals == (2,)


def test_a_leafs_own_param_borrowed_without_grad_is_refused_when_read_with_grad():
    """moe returns e to lin under no_grad (borrowed, allowed); a later read of e with grad is
    refused as a first one would be, not let through because e is already lin's external."""
    st = lifecycle(*MODEL)
    st, _ = calls.enter(st, Enter(module=0, grad=True, grad_inputs=True), config=CFG)
    st, _ = calls.enter(st, Enter(module=4, grad=True, grad_inputs=True), config=CFG)
    st, _ = calls.enter(st, Enter(module=3, grad=True, grad_inputs=True), config=CFG)
    st, _ = calls.leave(st, Leave(module=3, grad_outputs=False, returned=(2,)), config=CFG)
    assert calls.read(st, Read(owner=3, param=2, grad=False), config=CFG) == (st, ())
    with pytest.raises(ValueError, match=r"param 'e' belongs to the leaf module 'moe' only, and "
                                         r"module 'lin' uses it \(reads it\)"):
        calls.read(st, Read(owner=3, param=2), config=CFG)


def test_raised_without_its_call_open_changes_nothing():
    """The forward raised in a pre-forward hook before ours opened the call: no call of it on top
    of the stack (none at all, or another module's), so nothing is closed."""
    st = lifecycle(*MODEL)
    assert calls.raised(st, Raised(module=1), config=CFG) == (st, ())
    st, _ = calls.enter(st, Enter(module=0, grad=True, grad_inputs=True), config=CFG)
    st, _ = calls.enter(st, Enter(module=4, grad=True, grad_inputs=True), config=CFG)
    assert calls.raised(st, Raised(module=1), config=CFG) == (st, ())


def test_a_root_that_raises_releases_its_params_then_ends_the_pass():
    st = lifecycle([("r", 8)], [("", [0], False)])
    st, _ = calls.enter(st, Enter(module=0, grad=True, grad_inputs=True), config=CFG)
    st, eff = calls.raised(st, Raised(module=0), config=CFG)
    assert eff == (Free((0,)), EndPass())


def test_a_read_outside_any_call_borrows_nothing():
    st = lifecycle(*MODEL)
    assert calls.read(st, Read(owner=4, param=3), config=CFG) == (st, ())


def test_reading_a_leafs_frozen_param_with_grad_is_allowed():
    """A frozen param gets no grad, so a leaf's own frozen param may be borrowed with grad."""
    st = lifecycle(*MODEL, trainable=[True, True, False, True])
    st, _ = calls.enter(st, Enter(module=0, grad=True, grad_inputs=True), config=CFG)
    st, _ = calls.enter(st, Enter(module=4, grad=True, grad_inputs=True), config=CFG)
    st, _ = calls.read(st, Read(owner=3, param=2), config=CFG)
    assert st.params.modules[4].externals == (2,)


# ---- the step: which params have a grad, and a step skipped ([Note: no grad, no step]) --------------

def backward_through_lin_and_moe(moe_grad: bool):
    """One pass: the root calls lin (v: hooked) and moe (the leaf, e); e has a grad from autograd
    if `moe_grad`; w (emb) and g (norm) are never used."""
    st = lifecycle(*MODEL)
    st, _ = calls.enter(st, Enter(module=0, grad=True, grad_inputs=True), config=CFG)
    for m in (4, 3):
        st, _ = calls.enter(st, Enter(module=m, grad=True, grad_inputs=True), config=CFG)
        st, _ = calls.leave(st, Leave(module=m, grad_outputs=True), config=CFG)
    st, _ = calls.leave(st, Leave(module=0, grad_outputs=True), config=CFG)
    for m in (0, 3):
        st, _ = calls.pre_backward(st, PreBackwardRan(module=m), config=CFG)
    st, reduced = calls.post_backward(st, PostBackwardRan(module=3, with_grad=frozenset({2}) if moe_grad else frozenset()),
                                      config=CFG)
    st, _ = calls.pre_backward(st, PreBackwardRan(module=4), config=CFG)
    st, _ = calls.grad_ready(st, GradReady(param=3, dtype="float32"), config=CFG)
    st, _ = calls.post_backward(st, PostBackwardRan(module=4), config=CFG)
    st, _ = calls.end_of_backward(st, BackwardEnded(), config=CFG)
    return st, reduced


@pytest.mark.parametrize("moe_grad", [False, True])
def test_a_leaf_param_with_a_grad_gets_no_zeros_and_counts_as_a_grad(moe_grad):
    """What torch shows (with_grad) decides the zeros: e with a grad is reduced as it is (no
    ZeroGrads) and got its grad in this window; without one, zeros stand in and it did not."""
    st, reduced = backward_through_lin_and_moe(moe_grad)
    assert (ZeroGrads((2,)) in reduced) is not moe_grad
    assert any(isinstance(e, CopyToBucket) and e.param == 2 for e in reduced)  # reduced either way
    assert calls.leaf_grads_seen(st) == (moe_grad,)
    assert st.calls.tables.leaf_own == (2,) and st.calls.tables.leaf_own_of == ((), (), (), (2,), ())


@pytest.mark.parametrize("moe_grad", [False, True])
def test_the_step_leaves_every_param_without_a_grad_in_its_window_without_one(moe_grad):
    """StepOptimizer names the trainable params no grad reached: w and g (never used), and e
    unless this rank or another got a real grad for it (leaf_grads)."""
    st, _ = backward_through_lin_and_moe(moe_grad)
    _, eff = stepped(st)  # leaf_grads None: this rank's own
    assert eff[0] == StepOptimizer((0, 1) if moe_grad else (0, 1, 2))
    assert FreePartitions() in eff
    if not moe_grad:  # what the other ranks say decides
        _, eff = stepped(st, leaf_grads=frozenset({2}))  # another rank's expert got one
        assert eff[0] == StepOptimizer((0, 1))
        _, eff = stepped(st, leaf_grads=frozenset())
        assert eff[0] == StepOptimizer((0, 1, 2))


def test_frozen_params_are_never_named_without_a_grad():
    """A frozen param has no optimizer grad anyway: only trainable ones are named."""
    st = forward_through_lin(lifecycle(*MODEL, [False, True, True, True]))  # w frozen
    st, _ = calls.end_of_backward(st, BackwardEnded(), config=CFG)
    _, eff = stepped(st)
    assert eff[0] == StepOptimizer((1, 2, 3))


def test_a_step_with_a_grad_norm_not_finite_is_skipped_and_the_weights_stay():
    """SkipStep(the step's number), the window closes (counted as skipped), and nothing of the
    params' lifecycle moves: no Free, no gather (the shards did not change)."""
    st, _ = backward_through_lin_and_moe(True)
    params = st.params
    st, eff = stepped(st, finite=False)
    assert eff == (SkipStep(1), FreePartitions())
    assert st.params is params and (st.grads.window, st.grads.micro_step, st.grads.skipped) == (1, 0, 1)
    assert st.grads.applied is False
    st, _ = backward_through_lin_and_moe(True)
    st, eff = stepped(st)
    assert isinstance(eff[0], StepOptimizer) and st.grads.applied is True and st.grads.skipped == 0
