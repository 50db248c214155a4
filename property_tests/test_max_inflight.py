"""Gathers in flight at once are a parameter of the core (Config.max_ongoing_fetch_events,
ModelSpec.max_inflight; DeepSpeed's hard-coded __max_ongoing_fetch_events, 2): the param
lifecycle's gather waits the oldest in flight before it issues one past the bound
(fz3/core/param/state.py `gather`).

Drawn cases run through the param machine's checks (naive model, invariants: check_state fails
past the spec's bound) at bounds 1-4, and the effect stream never has more than the bound
outstanding; with prefetch reaching far on a chain of modules the bound is reached, so it is
what bounds. The teeth: a gather that keeps the constant 2 is caught at bound 1."""
import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fz3.config.config import Config
from fz3.core.effects import AllGather, Wait
from fz3.core.param import state
from fz3.testing.models import HUGE, Call, Case, Model, cases
from fz3.testing.param_machine import run_passes
from fz3.testing.patch import patched

SCHEDULE = [(0, "complete"), (0, "complete"), (0, "step"), (0, "complete")]


def most_in_flight(out) -> int:
    """The most gathers issued and not yet waited, over the effect stream of a run."""
    outstanding, most = set(), 0
    for entry in out:
        for _, effects in entry:
            for e in effects:
                if type(e) is AllGather:
                    outstanding.add(e.handle)
                    most = max(most, len(outstanding))
                elif type(e) is Wait:
                    outstanding.discard(e.handle)
    return most


@settings(max_examples=60, deadline=None)
@given(case=cases(), bound=st.integers(1, 4))
def test_gathers_in_flight_stay_within_the_bound(case, bound):
    case = dataclasses.replace(case, config=case.config.replace(max_ongoing_fetch_events=bound))
    _, out = run_passes(case, SCHEDULE)  # every check of the param machine, check_state's bound
    assert most_in_flight(out) <= bound


def _chain(n: int) -> Case:
    """A root calling n modules in a row, one param of 4 elements each; prefetch reaches 16
    elements ahead, so each fetch after the first pass has a gather of its own in flight."""
    model = Model(world_size=2, params=tuple((f"p{i}", 4) for i in range(n)),
                  modules=(("root", (), False),) + tuple((f"m{i}", (i,), False) for i in range(n)),
                  callable=tuple(range(1, n + 1)))
    program = Call(0, True, 1, tuple(Call(i + 1, True, 1) for i in range(n)))
    return Case(model, Config(prefetch_bucket_size=16, max_live_parameters=HUGE, max_reuse_distance=0,
                              param_persistence_threshold=0), (program,))


@pytest.mark.parametrize("bound", [1, 2, 3, 4])
def test_prefetch_reaches_the_bound(bound):
    case = _chain(8)
    case = dataclasses.replace(case, config=case.config.replace(max_ongoing_fetch_events=bound))
    _, out = run_passes(case, SCHEDULE)
    assert most_in_flight(out) == bound


def constant_bound(tx, pids, *, prefetch, forward, fetched_for):
    """Planted: the gather waits past DeepSpeed's constant 2, not the spec's bound."""
    st = tx.st
    tx.st = st._replace(spec=dataclasses.replace(st.spec, max_inflight=state.MAX_INFLIGHT))
    try:
        REAL_GATHER(tx, pids, prefetch=prefetch, forward=forward, fetched_for=fetched_for)
    finally:
        tx.st = st


REAL_GATHER = state.gather


def test_a_gather_keeping_the_constant_is_caught():
    with patched("fz3.core.param.state:gather", constant_bound):
        with pytest.raises(AssertionError, match="in flight"):  # the naive model or check_state
            test_prefetch_reaches_the_bound(1)
