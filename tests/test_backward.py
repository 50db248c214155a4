"""Backward bookkeeping and external params (fz3/core/param/backward.py).

fetch_for_backward fetches once per forward call whose outputs were wrapped;
release_after_backward ends one call's backward and releases what it fetched (the params go once no call of the module is open);
a module without wrapped inputs waits for finish_backward. External
params are gathered at registration, fetched with their module, freed only by end_of_step.
"""
from __future__ import annotations

import pytest

from fz3.core.param.backward import fetch_for_backward, register_external, release_after_backward
from fz3.config.config import Config
from fz3.core.effects import AllGather, Free, Wait
from fz3.core.param.fetch import fetch
from fz3.core.ids import Status, TraceMode
from fz3.core.param.invariants import check_fetched, check_quiescent
from fz3.core.param.release import release
from fz3.core.param.step import end_of_step, finish_backward, reset_step
from fz3.core.param.trace import UNIT_GREW
from tests.support.driver import Driver

CFG = Config(prefetch_bucket_size=0, param_persistence_threshold=0, max_reuse_distance=0)
BLOCK = ([("blk.w", 4)], [("", [], False), ("blk", [0], False)])


def G(h, ps, forward=True):
    return AllGather(h, tuple(ps), False, forward)


def test_wrapping_counts():
    """A call's wrapped outputs count one backward fetch (release(grad_outputs=True)), its
    wrapped inputs one backward release (fetch(grad_inputs=1)); 0 counts nothing."""
    d = Driver(*BLOCK, config=CFG)
    d(reset_step)
    for inputs in (1, 0, 1):
        d(fetch, 1, forward=True, grad_inputs=inputs)
        d(release, 1, grad_outputs=True)
    assert (d.st.modules[1].pre_backward, d.st.modules[1].grads_remaining) == (3, 2)
    for bad in (-1, 2):
        with pytest.raises(ValueError, match=f"grad_inputs must be 0 or 1.*got {bad}"):
            fetch(d.st, 1, forward=True, config=CFG, grad_inputs=bad)


def test_module_called_twice_is_fetched_twice_in_backward():
    """ALBERT-style reuse: two forward calls, two backward fetches, each call's backward
    releases what it fetched ([Note: release per call])."""
    d = Driver(*BLOCK, config=CFG)
    d(reset_step)
    d(fetch, 0, forward=True)
    for h in (0, 1):
        assert d(fetch, 1, forward=True, grad_inputs=1) == [G(h, [0]), Wait(h)]
        assert d(release, 1, grad_outputs=True) == [Free((0,), refetch=True)]  # its backward gathers it again
    d(release, 0, grad_outputs=True)
    assert (d.st.modules[1].pre_backward, d.st.modules[1].grads_remaining) == (2, 2)
    assert d(fetch_for_backward, 0) == []
    assert d(fetch_for_backward, 1) == [G(2, [0], forward=False), Wait(2)]  # call 2
    assert d(release_after_backward, 1) == [Free((0,), refetch=True)]  # call 2's backward is done; call 1's to come
    assert d(fetch_for_backward, 1) == [G(3, [0], forward=False), Wait(3)]  # call 1
    check_fetched(d.st, 1)
    assert d(release_after_backward, 1) == [Free((0,))]
    assert (d.st.modules[1].pre_backward, d.st.modules[1].grads_remaining) == (0, 0)
    assert d(finish_backward) == []
    check_quiescent(d.st)


def test_interleaved_backward_calls_free_at_the_last_close():
    """Two calls whose backward interleaves (pre 2, pre 1, post 2, post 1): the params stay
    while either call is open, the module counts once among their users."""
    d = Driver(*BLOCK, config=CFG)
    d(reset_step)
    for _ in (0, 1):
        d(fetch, 1, forward=True, grad_inputs=1)
        d(release, 1, grad_outputs=True)
    assert d(fetch_for_backward, 1) == [G(2, [0], forward=False), Wait(2)]
    assert d(fetch_for_backward, 1) == []
    assert d.st.modules[1].active == 2 and d.st.params[0].users == 1
    assert d(release_after_backward, 1) == []  # call 1 is still open
    check_fetched(d.st, 1)
    assert d(release_after_backward, 1) == [Free((0,))]
    assert d.st.modules[1].active == 0 and d.st.params[0].users == 0
    assert d(finish_backward) == []
    check_quiescent(d.st)


def test_extra_hooks_are_no_ops():
    d = Driver(*BLOCK, config=CFG)
    st = d.st
    assert fetch_for_backward(st, 1, config=CFG) == (st, ())
    assert release_after_backward(st, 1, config=CFG) == (st, ())


def test_module_without_grad_inputs_waits_for_finish_backward():
    d = Driver(*BLOCK, config=CFG)
    d(reset_step)
    d.forward([[0, [1]]], inputs=0)
    assert d(fetch_for_backward, 0) == []
    assert d(fetch_for_backward, 1) == [G(1, [0], forward=False), Wait(1)]
    assert d(release_after_backward, 1) == []  # no input was wrapped: nothing to count down
    assert d.statuses() == "A"
    assert d(finish_backward) == [Free((0,))]
    check_quiescent(d.st)
    assert not d.st.modules[1].active


def test_external_param_lifecycle():
    """child returns its param to the root: registered on the root, gathered at once, kept
    through release, finish_backward and reset_step, freed by end_of_step."""
    d = Driver([("child.w", 4), ("other.w", 4)],
               [("", [], False), ("child", [0], False), ("other", [1], False)], config=CFG)
    d(reset_step)
    d(fetch, 0, forward=True)
    d(fetch, 1, forward=True)
    assert d(release, 1) == [Free((0,))]
    assert d(register_external, 0, (0,)) == [G(1, [0]), Wait(1)]
    assert d.st.params[0].external and d.st.modules[0].externals == (0,)
    assert d.st.params[0].users == 1  # the root is active and uses it now
    assert d(register_external, 0, (0,)) == []  # known
    assert d(release, 0) == []
    assert d(finish_backward) == [] and d.statuses() == "AN"
    check_quiescent(d.st)
    assert d(reset_step) == [] and d.statuses() == "AN"
    assert d(fetch, 0, forward=True) == []  # part of the root's unit, still gathered
    d(release, 0)
    d(finish_backward)
    assert d(end_of_step) == [Free((0,))]
    d(reset_step)
    assert d(fetch, 0, forward=True) == [G(0, [0]), Wait(0)]  # fetched with its module (a pass's handles count from 0)


def test_registering_on_an_inactive_module_adds_no_user():
    """The post-forward dangling-param scan registers after the module's release: the param is
    gathered and marked external, but no open call of the module counts among its users."""
    d = Driver([("child.w", 4), ("other.w", 4)],
               [("", [], False), ("child", [0], False), ("other", [1], False)], config=CFG)
    d(reset_step)
    d(fetch, 0, forward=True)
    d(release, 0)
    assert d(register_external, 0, (1,)) == [G(0, [1]), Wait(0)]
    assert not d.st.modules[0].active and d.st.modules[0].externals == (1,)
    assert tuple(d.st.params[1])[:5] == (Status.AVAILABLE, None, 0, 0, True)  # users 0, fetched for step 0
    assert d(fetch, 0, forward=True) == []  # gathered already; now the root uses it
    assert d.st.params[1].users == 1


def test_new_external_param_departs_from_a_complete_plan_at_its_module():
    """On a COMPLETE trace, registering invalidates the plan and logs the departure as
    (fetch index, the module that took the param, UNIT_GREW), not as an order mismatch."""
    d = Driver([("a.w", 4), ("b.w", 4)], [("", [], False), ("a", [0], False), ("b", [1], False)],
               config=CFG)
    for _ in range(2):  # RECORD, then COMPLETE with plan (root, a)
        d(reset_step)
        d.forward([[0, [1]]], inputs=0)
    assert d.st.trace.mode is TraceMode.COMPLETE and d.st.trace.plan.order == (0, 1)
    d(reset_step)
    assert d(fetch, 0, forward=True) == []
    assert d(fetch, 1, forward=True) == [G(0, [0]), Wait(0)]  # a pass's handles count from 0
    assert d(register_external, 1, (1,)) == [G(1, [1]), Wait(1)]
    assert d.st.trace.mode is TraceMode.INVALID and d.st.trace.invalidations == 1
    assert d.st.trace.departure == (1, 1, UNIT_GREW)  # a, fetched second (index 1), took b.w
    assert d.st.params[1].users == 1 and d.statuses() == "AA"


def test_registering_an_own_param_is_a_no_op():
    d = Driver(*BLOCK, config=CFG)
    d(reset_step)
    d(fetch, 1, forward=True)
    assert d(register_external, 1, (0,)) == []
    assert not d.st.params[0].external
