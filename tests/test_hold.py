"""gathered_parameters' core half (fz3/core/param/hold.py): a hold is a user like an active module."""
from __future__ import annotations

import pytest

from fz3.config.config import Config
from fz3.core.effects import AllGather, Free, Refresh, Wait
from fz3.core.param.fetch import fetch
from fz3.core.param.hold import hold, unhold
from fz3.core.param.invariants import check_quiescent
from fz3.core.param.release import release
from fz3.core.param.step import end_of_step, finish_backward, reset_step
from tests.support.driver import Driver

CFG = Config(prefetch_bucket_size=0, max_reuse_distance=0, param_persistence_threshold=1)
# p0 4 elements (m1), p1 1 element: persistent (m2)
MODEL = ([("w", 4), ("b", 1)], [("", [], False), ("m1", [0], False), ("m2", [1], False)])


def test_hold_gathers_once_and_counts():
    d = Driver(*MODEL, config=CFG)
    assert d(hold, (0, 0)) == [AllGather(0, (0,), False, True), Wait(0)]
    assert d(hold, (0,)) == []  # nested: already gathered
    assert d.st.params[0].users == 2 and d.st.held == (0, 0)
    assert d(unhold, (0,), stale=False) == []
    assert d(unhold, (0,), stale=False) == [Free((0,))]
    with pytest.raises(ValueError, match="not held"):
        unhold(d.st, (0,), config=CFG)


def test_release_and_sweeps_keep_held_params():
    d = Driver(*MODEL, config=CFG)
    d(hold, (0,))
    d(reset_step)
    d(fetch, 1, forward=True)
    assert d(release, 1) == []  # held: not the module's to free
    assert d(finish_backward) == [] and d.statuses() == "AN"
    check_quiescent(d.st)  # an open hold is not a leak
    assert d(reset_step) == [] and d.st.params[0].users == 1


@pytest.mark.parametrize("stale,freed", [(False, []), (True, [Free((1,))])])
def test_unhold_of_persistent_frees_only_stale(stale, freed):
    d = Driver(*MODEL, config=CFG)
    d(hold, (1,))
    assert d(unhold, (1,), stale=stale) == freed


def test_unhold_leaves_params_an_active_module_uses():
    d = Driver(*MODEL, config=CFG)
    d(reset_step)
    d(fetch, 1, forward=True)
    d(hold, (0,))
    assert d(unhold, (0,), stale=True) == []
    assert d(release, 1) == [Free((0,))]


def test_optimizer_step_inside_gathered_parameters():
    """end_of_step frees every stale full param; a held one is refreshed in place with the
    persistent ones and keeps its hold (regression: it was freed and its users zeroed)."""
    d = Driver(*MODEL, config=CFG)
    d(hold, (0,))
    d(reset_step)
    d.forward([[0, [1, 2]]], inputs=0)
    d(finish_backward)
    assert d(end_of_step) == [Refresh((0, 1))]  # held (and persistent): gathered again where they lie
    assert d.st.params[0].users == 1 and d.statuses() == "AA"
    assert d(unhold, (0,), stale=False) == [Free((0,))]


def test_a_held_param_is_marked_fetched_for_no_step():
    """hold gathers for no trace step (fetched_for -1): a module that fetches the param later
    marks its own step, and its release frees the param as if the hold had not gathered it
    (a mark of a later step would keep it, as if prefetched for that step)."""
    d = Driver(*MODEL, config=CFG)
    d(reset_step)
    d.forward([1, 2], inputs=0)  # RECORD: m1 is step 0, m2 step 1
    d(reset_step)  # the next pass runs on the COMPLETE trace
    d(hold, (0,))
    assert d.st.params[0].fetched_for == -1
    d(fetch, 1, forward=True)
    assert d.st.params[0].fetched_for == 0
    assert d(unhold, (0,), stale=False) == []  # m1 still uses it
    assert d(release, 1) == [Free((0,))]


def test_unhold_assumes_stale_by_default():
    """Without `stale`, the full values may have been edited: even a persistent param is freed,
    so the next fetch gathers the current shards."""
    d = Driver(*MODEL, config=CFG)
    d(hold, (1,))
    assert d(unhold, (1,)) == [Free((1,))]
    assert d.statuses() == "NN"
