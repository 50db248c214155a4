"""Pass- and step-level transitions (fz3/core/step.py): reset_step, finish_backward, end_of_step."""
from __future__ import annotations

from fz3.core.backward import post_backward, pre_backward, register_external
from fz3.core.config import Config
from fz3.core.effects import AllGather, Free, Wait
from fz3.core.fetch import fetch
from fz3.core.ids import TraceMode
from fz3.core.invariants import check_quiescent
from fz3.core.release import release
from fz3.core.step import end_of_step, finish_backward, reset_step
from fz3.testing.driver import Driver

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
        d(pre_backward, m)
        if m:
            d(post_backward, m)
    d(post_backward, 0)
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
    d(pre_backward, 0)
    d(pre_backward, 2)
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


def test_end_of_step_frees_everything_and_regathers_persistent():
    d = Driver(*MODEL, config=cfg())
    d(reset_step)
    d(fetch, 0, forward=True)
    d(register_external, 0, (1,))  # a's weight read by the root
    d(release, 0)
    d(finish_backward)
    assert d.statuses() == "AAN"
    h = d.st.next_handle
    assert d(end_of_step) == [Free((0, 1)), AllGather(h, (0,), False, True), Wait(h)]
    assert d.statuses() == "ANN" and d.live == 2
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
