"""Pass- and step-level transitions (fz3/core/param/step.py): reset_step, finish_backward, end_of_step."""
from __future__ import annotations

from fz3.core.param.backward import fetch_for_backward, register_external, release_after_backward
from fz3.config.config import Config
from fz3.core.effects import AllGather, Free, Refresh, Wait
from fz3.core.param.fetch import fetch
from fz3.core.param.hold import hold, unhold
from fz3.core.ids import TraceMode
from fz3.core.param.invariants import check_quiescent
from fz3.core.param.release import release
from fz3.core.param.step import end_of_step, finish_backward, reset_step
from fz3.core.param.trace import UNIT_GREW
from tests.support.driver import Driver

HUGE = 10**9
# root owns a persistent bias (2 <= threshold 2); a and b own 4-element weights
MODEL = ([("bias", 2), ("a.w", 4), ("b.w", 4)],
         [("", [0], False), ("a", [1], False), ("b", [2], False)])


def cfg(bucket=0):
    return Config(prefetch_bucket_size=bucket, max_live_parameters=HUGE, max_reuse_distance=0,
                  param_persistence_threshold=2)


def train_pass(d: Driver) -> list:
    """reset, forward root[a, b] (each call: outputs + one input wrapped), complete backward,
    finish; -> the effects of finish_backward."""
    d(reset_step)
    d.forward([[0, [1, 2]]], inputs=1)
    for m in (0, 2, 1):
        d(fetch_for_backward, m)
        if m:
            d(release_after_backward, m)
    d(release_after_backward, 0)
    effects = d(finish_backward)
    check_quiescent(d.st)
    return effects


def test_complete_backward_leaves_nothing_to_finish():
    d = Driver(*MODEL, config=cfg())
    assert train_pass(d) == []
    assert d.statuses() == "ANN"  # the persistent bias stays for the whole step


def test_finish_backward_drains_and_frees_leftovers():
    """b's grads never arrive (no post_backward): finish_backward frees it, zeroes counters."""
    d = Driver(*MODEL, config=cfg())
    d(reset_step)
    d.forward([[0, [1, 2]]], inputs=1)
    d(fetch_for_backward, 0)
    d(fetch_for_backward, 2)
    assert d.statuses() == "ANA"
    assert d(finish_backward) == [Free((2,))]
    check_quiescent(d.st)
    assert [m.active for m in d.st.modules] == [False, False, False]


def test_reset_step_drains_inflight_prefetch_and_closes_the_pass():
    d = Driver(*MODEL, config=cfg(bucket=HUGE))
    train_pass(d)
    train_pass(d)  # COMPLETE from here
    d(reset_step)
    h = d.st.next_handle
    assert d(fetch, 0, forward=True) == [AllGather(h, (1, 2), True, True)]
    # the forward stops here (an exception, say); the next pass starts
    assert d(reset_step) == [Wait(h), Free((1, 2))]
    assert d.statuses() == "ANN" and not d.st.inflight
    assert d.st.trace.mode is TraceMode.RECORD and d.st.trace.invalidations == 1  # ended early


def test_end_of_step_frees_everything_and_refreshes_persistent():
    d = Driver(*MODEL, config=cfg())
    d(reset_step)
    d(fetch, 0, forward=True)
    d(register_external, 0, (1,))  # a's weight read by the root
    d(release, 0)
    d(finish_backward)
    assert d.statuses() == "AAN"
    h = d.st.next_handle
    # the persistent p0 stays where it lies and is gathered again into it: nothing freed or set
    assert d(end_of_step) == [Free((1,)), Refresh((0,))]
    assert d.statuses() == "ANN" and d.live == 2
    assert d.st.next_handle == h and d.st.params[0].fetched_for == -1
    check_quiescent(d.st)


def test_end_of_step_with_nothing_live_is_silent():
    d = Driver(*MODEL, config=Config(param_persistence_threshold=0))
    assert d(end_of_step) == []


def test_gradient_accumulation_keeps_the_trace():
    """Two micro-steps, then the optimizer step: the trace stays COMPLETE across it."""
    d = Driver(*MODEL, config=cfg(bucket=HUGE))
    for _ in range(2):
        train_pass(d)
    d(end_of_step)
    for _ in range(2):
        train_pass(d)
    d(end_of_step)
    train_pass(d)
    assert d.st.trace.mode is TraceMode.COMPLETE and d.st.trace.invalidations == 0


def test_end_of_step_refreshes_held_params_for_no_step():
    """A param a gathered_parameters holds across the optimizer step is refreshed, marked
    fetched_for -1 (for no step): on the next COMPLETE pass, once the hold is gone, the release
    of the module at step 0 frees it like any param, not as one prefetched for a later step."""
    d = Driver([("w", 4)], [("", [], False), ("m", [0], False)], config=cfg())
    for _ in range(2):  # RECORD, then COMPLETE with the plan (m,)
        d(reset_step)
        d(fetch, 1, forward=True)
        d(release, 1)
    d(hold, (0,))
    assert d(end_of_step) == [Refresh((0,))]  # held: gathered again where it lies
    assert d.st.params[0].fetched_for == -1 and d.st.params[0].users == 1
    d(reset_step)
    assert d.st.trace.mode is TraceMode.COMPLETE
    assert d(fetch, 1, forward=True) == []  # still gathered for the hold
    assert d.st.params[0].fetched_for == 0  # the fetch marks it for its own step
    assert d(unhold, (0,), stale=False) == []  # m still uses it
    assert d(release, 1) == [Free((0,))]  # not prefetched for a step after 0: freed


def complete_trace() -> Driver:
    """Two training passes over root[a, b]: the plan is (root, a, b, root, b, a)."""
    d = Driver(*MODEL, config=cfg())
    train_pass(d)
    train_pass(d)
    d(reset_step)
    assert d.st.trace.mode is TraceMode.COMPLETE and d.st.trace.plan.order == (0, 1, 2, 0, 2, 1)
    return d


def test_fetch_departure_records_module_and_expected():
    """A fetch off the plan invalidates the trace with the module fetched and the one the plan
    expected at that fetch index (not UNIT_GREW: the fetch units did not change)."""
    d = complete_trace()
    d(fetch, 0, forward=True)
    d(fetch, 2, forward=True)  # the plan expected a at index 1
    assert d.st.trace.mode is TraceMode.INVALID and d.st.trace.invalidations == 1
    assert d.st.trace.departure == (1, 2, 1)


def test_register_external_departure_expects_externals():
    """On a COMPLETE trace, a module taking params it does not own invalidates the trace with
    departure (its fetch index, it, UNIT_GREW), whatever module the plan has there."""
    d = complete_trace()
    d(fetch, 0, forward=True)
    d(register_external, 0, (1,))
    assert d.st.trace.mode is TraceMode.INVALID and d.st.trace.invalidations == 1
    assert d.st.trace.departure == (0, 0, UNIT_GREW)


def test_reset_step_defaults_to_a_grad_enabled_training_pass():
    """reset_step with no pass kind given starts a "train" pass (grad enabled, train mode): the
    trace built by such passes is the one an explicit grad_enabled=True, training=True pass takes
    up; a no_grad pass takes up another."""
    d = Driver(*MODEL, config=cfg())
    train_pass(d)
    assert d.st.trace.kind == "train" and d.st.trace.parked == ()
    train_pass(d)
    d(reset_step, grad_enabled=True, training=True)
    assert d.st.trace.kind == "train" and d.st.trace.mode is TraceMode.COMPLETE
    d(reset_step, grad_enabled=False)
    assert d.st.trace.kind == "train_no_grad" and d.st.trace.mode is TraceMode.RECORD
