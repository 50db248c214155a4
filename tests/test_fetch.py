"""fetch: gather on demand, wait, prefetch from a COMPLETE trace (fz3/core/param/fetch.py).

Exact effect sequences for small hand-written models. Handles count up from 0 over the run; a
"pass" here is reset_step plus a forward of root[children] (no backward, so the trace records
the forward order only).
"""
from __future__ import annotations

import pytest

from fz3.config.config import Config
from fz3.core.effects import AllGather, Free, Wait
from fz3.core.param.fetch import fetch
from fz3.core.ids import TraceMode
from fz3.core.param.invariants import check_fetched, check_live_budget
from fz3.core.param.release import release
from fz3.core.param.step import reset_step
from tests.support.driver import Driver

HUGE = 10**9
THREE = ([("a.w", 4), ("b.w", 4), ("c.w", 4)],
         [("", [], False), ("a", [0], False), ("b", [1], False), ("c", [2], False)])


def G(h, ps, prefetch=False, forward=True):
    return AllGather(h, tuple(ps), prefetch, forward)


def cfg(bucket=HUGE, live=HUGE, reuse=0, threshold=0):
    return Config(prefetch_bucket_size=bucket, max_live_parameters=live, max_reuse_distance=reuse,
                  param_persistence_threshold=threshold)


def one_pass(d: Driver, children) -> list[list]:
    """reset_step + forward of root[children]; -> effects per fetch/release, root's included."""
    d(reset_step)
    return d.forward([[0, list(children)]], inputs=0)


def test_first_fetch_gathers_and_waits():
    d = Driver(*THREE, config=cfg())
    d(reset_step)
    assert d(fetch, 0, forward=True) == []  # the root owns nothing
    assert d(fetch, 1, forward=True) == [G(0, [0]), Wait(0)]
    assert d.statuses() == "ANN" and d.live == 4
    check_fetched(d.st, 1)
    assert d.st.params[0].users == 1 and d.st.modules[1].active
    assert d(fetch, 2, forward=False) == [G(1, [1], forward=False), Wait(1)]


def test_fetch_of_available_params_is_silent():
    """A param already gathered (tied, or held by an active parent) is not gathered again."""
    d = Driver([("w", 4)], [("", [0], False), ("child", [0], False)], config=cfg())
    d(reset_step)
    assert d(fetch, 0, forward=True) == [G(0, [0]), Wait(0)]
    assert d(fetch, 1, forward=True) == []
    assert d.st.params[0].users == 2
    assert d(release, 1) == []  # the parent still uses it
    assert d(release, 0) == [Free((0,))]


def test_fetch_marks_an_available_param_for_its_own_later_step():
    """A fetch moves fetched_for up to its step even for a param it does not gather (held by
    an active parent): the mark is the latest step the param was fetched for."""
    d = Driver([("w", 4)], [("", [0], False), ("child", [0], False)], config=cfg())
    d(reset_step)
    d(fetch, 0, forward=True)
    assert d.st.params[0].fetched_for == 0
    assert d(fetch, 1, forward=True) == []
    assert d.st.params[0].fetched_for == 1


def test_prefetch_walk_goes_on_forward_from_its_step():
    """A walk that starts past a param too big for the live budget (b's, left to fetch on
    demand) goes on forward to the end of the queue; it never steps back to that param."""
    d = Driver([("a.w", 1), ("b.w", 100), ("c.w", 1), ("d.w", 1), ("e.w", 1)],
               [("", [], False), ("a", [0], False), ("b", [1], False), ("c", [2], False),
                ("d", [3], False), ("e", [4], False)], config=cfg(live=10))
    one_pass(d, [1, 2, 3, 4, 5])  # handles 0..4; the next pass counts from 0 again
    got = one_pass(d, [1, 2, 3, 4, 5])
    assert d.st.trace.mode is TraceMode.COMPLETE
    fetches = [got[i] for i in (0, 1, 3, 5, 7, 9)]  # root, a, b, c, d, e
    assert fetches == [[G(0, [0], True)], [Wait(0)], [G(1, [1]), Wait(1)],
                       [G(2, [2]), Wait(2), G(3, [3, 4], True)], [Wait(3)], []]


def test_bucket_zero_does_not_walk_the_plan():
    """prefetch_bucket_size 0 turns prefetch off: a COMPLETE pass leaves the queue cursor at 0,
    where a bucket of 1 moves it past each fetch's step."""
    for bucket, cursors in ((0, [0, 0, 0, 0]), (1, [1, 2, 3, 3])):
        d = Driver(*THREE, config=cfg(bucket=bucket))
        one_pass(d, [1, 2, 3])
        d(reset_step)
        assert d.st.trace.mode is TraceMode.COMPLETE
        got = []
        for m in (0, 1, 2, 3):
            d(fetch, m, forward=True)
            got.append(d.st.trace.cursor)
        assert got == cursors, bucket


# (prefetch_bucket_size, max_live_parameters) -> effects of the COMPLETE pass, event by event:
# fetch root, fetch a, release a, fetch b, release b, fetch c, release c, release root.
# Each pass's handles count from 0 (reset_step: [Note: a pass forgets], fz3/core/replay.py).
PREFETCH = [
    ("bucket 0: prefetch off", 0, HUGE,
     [[], [G(0, [0]), Wait(0)], [Free((0,), True)], [G(1, [1]), Wait(1)], [Free((1,), True)],
      [G(2, [2]), Wait(2)], [Free((2,), True)], []]),
    ("bucket 1: one param per batch", 1, HUGE,
     [[G(0, [0], True)], [Wait(0), G(1, [1], True)], [Free((0,), True)], [Wait(1), G(2, [2], True)],
      [Free((1,), True)], [Wait(2)], [Free((2,), True)], []]),
    ("bucket 4 = one param: the batch stops once it reaches the size", 4, HUGE,
     [[G(0, [0], True)], [Wait(0), G(1, [1], True)], [Free((0,), True)], [Wait(1), G(2, [2], True)],
      [Free((1,), True)], [Wait(2)], [Free((2,), True)], []]),
    ("bucket 8: two params, then the rest", 8, HUGE,
     [[G(0, [0, 1], True)], [Wait(0), G(1, [2], True)], [Free((0,), True)], [], [Free((1,), True)],
      [Wait(1)], [Free((2,), True)], []]),
    ("bucket huge: the whole plan at the first fetch", HUGE, HUGE,
     [[G(0, [0, 1, 2], True)], [Wait(0)], [Free((0,), True)], [], [Free((1,), True)], [], [Free((2,), True)], []]),
    ("live budget 4: one param ahead, none while a's is live", HUGE, 4,
     [[G(0, [0], True)], [Wait(0)], [Free((0,), True)], [G(1, [1]), Wait(1)], [Free((1,), True)],
      [G(2, [2]), Wait(2)], [Free((2,), True)], []]),
    ("live budget 0: nothing ahead", HUGE, 0,
     [[], [G(0, [0]), Wait(0)], [Free((0,), True)], [G(1, [1]), Wait(1)], [Free((1,), True)],
      [G(2, [2]), Wait(2)], [Free((2,), True)], []]),
]


@pytest.mark.parametrize("why,bucket,live,expected", PREFETCH, ids=[p[0] for p in PREFETCH])
def test_prefetch_table(why, bucket, live, expected):
    d = Driver(*THREE, config=cfg(bucket=bucket, live=live))
    first = one_pass(d, [1, 2, 3])
    assert d.st.trace.mode is TraceMode.RECORD and not any(
        isinstance(e, AllGather) and e.prefetch for es in first for e in es)
    got = one_pass(d, [1, 2, 3])
    assert d.st.trace.mode is TraceMode.COMPLETE
    assert got == expected
    assert d.st.peak_live_numel <= max(live, 4)


def test_at_most_two_gathers_in_flight():
    """Modules whose params are already gathered (a tied weight kept for reuse) move the reach on
    without waiting; the third gather waits the oldest first."""
    d = Driver([("w", 8), ("a.w", 8), ("b.w", 8), ("c.w", 8)],
               [("", [], False), ("e", [0], False), ("x", [0], False), ("y", [0], False),
                ("z", [0], False), ("a", [1], False), ("b", [2], False), ("c", [3], False)],
               config=cfg(bucket=17, reuse=HUGE))
    one_pass(d, [1, 2, 3, 4, 5, 6, 7])
    got = one_pass(d, [1, 2, 3, 4, 5, 6, 7])
    fetches = [got[i] for i in (0, 1, 3, 5, 7, 9, 11, 13)]  # root, e, x, y, z, a, b, c
    assert fetches == [[G(0, [0], True)], [Wait(0)], [G(1, [1], True)], [G(2, [2], True)],
                       [Wait(1), G(3, [3], True)], [], [Wait(2)], [Wait(3)]]
    assert len(d.st.inflight) == 0


def test_prefetch_reaches_a_bucket_ahead_not_a_bucket_more_each_fetch():
    """[Note: prefetch bounds] Params gathered ahead of need stay within prefetch_bucket_size
    elements of the plan: modules without params do not move the reach, so a chain of them
    prefetches nothing more (DeepSpeed's loop would take another bucket at each of them, up to
    max_live_parameters)."""
    d = Driver([("a.w", 4), ("b.w", 4), ("c.w", 4)],
               [("", [], False), ("x", [], False), ("y", [], False), ("a", [0], False),
                ("b", [1], False), ("c", [2], False)], config=cfg(bucket=4))
    one_pass(d, [1, 2, 3, 4, 5])
    got = one_pass(d, [1, 2, 3, 4, 5])
    fetches = [got[i] for i in (0, 1, 3, 5, 7, 9)]  # root, x, y, a, b, c
    assert fetches == [[G(0, [0], True)], [], [], [Wait(0), G(1, [1], True)], [Wait(1), G(2, [2], True)],
                       [Wait(2)]]
    assert d.st.peak_live_numel == 8  # one in use, one ahead


def test_departure_invalidates_and_drops_prefetched_params():
    d = Driver(*THREE, config=cfg())
    one_pass(d, [1, 2, 3])
    one_pass(d, [1, 2, 3])  # COMPLETE; its handle 0 prefetched everything
    d(reset_step)
    assert d(fetch, 0, forward=True) == [G(0, [0, 1, 2], True)]
    assert d.statuses() == "III"
    # the plan expects a; b departs: drain, free the prefetched params b does not use; b's own
    # p1 stays (the sweep runs after b counts among its users), so nothing is gathered again
    assert d(fetch, 2, forward=True) == [Wait(0), Free((0, 2))]
    assert d.st.trace.mode is TraceMode.INVALID and d.st.trace.invalidations == 1
    assert d(fetch, 1, forward=True) == [G(1, [0]), Wait(1)]  # no prefetch while INVALID


def test_departure_records_the_fetch_and_the_module_the_plan_expected():
    """An invalidating fetch records (its index in the pass, the module fetched, the module the
    plan expected there)."""
    d = Driver(*THREE, config=cfg())
    one_pass(d, [1, 2, 3])
    one_pass(d, [1, 2, 3])
    d(reset_step)
    d(fetch, 0, forward=True)
    d(fetch, 2, forward=True)  # the plan expects a (module 1) at index 1
    assert d.st.trace.departure == (1, 2, 1)


def test_departure_survives_prefetch_in_later_passes():
    """The last departure stays on the trace through the passes that record and follow a new
    plan, prefetch included."""
    d = Driver(*THREE, config=cfg())
    one_pass(d, [1, 2, 3])
    one_pass(d, [1, 2, 3])
    one_pass(d, [2, 1, 3])  # departs at index 1: fetched b, the plan expected a
    one_pass(d, [2, 1, 3])  # RECORD
    got = one_pass(d, [2, 1, 3])  # COMPLETE: prefetches
    assert got[0] == [G(0, [0, 1, 2], True)]
    assert d.st.trace.mode is TraceMode.COMPLETE and d.st.trace.invalidations == 1
    assert d.st.trace.departure == (1, 2, 1)


def test_prefetch_respects_live_budget_exactly():
    """I1: a param that would lift live numel past the budget is not prefetched."""
    d = Driver([("a.w", 3), ("b.w", 3), ("c.w", 3)], THREE[1], config=cfg(live=7))
    one_pass(d, [1, 2, 3])
    d(reset_step)
    effects = d(fetch, 0, forward=True)
    assert effects == [G(0, [0, 1], True)] and d.live == 6
    check_live_budget(d.st, effects, config=d.config)


def test_zero_numel_and_empty_modules():
    d = Driver([("empty", 0), ("w", 2)], [("", [], False), ("m", [0, 1], False)],
               config=cfg(threshold=0))
    d(reset_step)
    assert d(fetch, 1, forward=True) == [G(0, [0, 1]), Wait(0)]
    assert d(release, 1) == [Free((1,))]  # numel 0 <= threshold 0: persistent
    assert d.statuses() == "AN"


def test_grad_inputs_counts_one_backward_release():
    d = Driver(*THREE, config=cfg())
    d(reset_step)
    d(fetch, 1, forward=True, grad_inputs=1)
    assert d.st.modules[1].grads_remaining == 1 and d.st.modules[1].active == 1
    with pytest.raises(ValueError):
        d(fetch, 2, forward=True, grad_inputs=-1)


def test_the_engine_takes_max_ongoing_fetch_events_and_trains_the_same():
    """Config.max_ongoing_fetch_events reaches the engine's core (its spec) and changes only when
    gathers are waited, never the numbers: 1, 2 (DeepSpeed's constant) and 4 train alike."""
    import torch
    from torch import nn

    import fz3
    from fz3 import launch

    def train(rank, world, bound):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)])
        engine = fz3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                fz3.Config(param_persistence_threshold=0, prefetch_bucket_size=150,
                                           max_ongoing_fetch_events=bound))
        g = torch.Generator().manual_seed(rank)
        for _ in range(3):
            engine.backward(engine(torch.randn(4, 8, generator=g)).square().mean())
            engine.step()
        return engine.spec.max_inflight, [m.detach().clone() for m in engine.store.masters]

    runs = {b: launch.run_threads(train, 2, args=(b,)) for b in (1, 2, 4)}
    for b, ranks in runs.items():
        assert all(bound == b for bound, _ in ranks)
        for (_, got), (_, want) in zip(ranks, runs[2]):
            assert all(torch.equal(x, y) for x, y in zip(got, want))
