"""fz3.core.param.invariants: each checker passes at its bound and fails on one planted defect.

States are built by hand, slot by slot (`ParamState.with_slots`): a param slot is a
ParamSlot(status, handle, users, fetched_for, external), a module slot a ModuleSlot(pre_backward,
grads_remaining, fetch_step, active, externals). Each failing state holds exactly the defect its check guards
against, and the match names the offending param, module or handle.
"""
from __future__ import annotations

import pytest

from fz3.config.config import Config
from fz3.core.effects import AllGather, Free, Wait
from fz3.core.param.invariants import (InvariantError, check_fetched, check_live_budget,
                                 check_prefetch_reach, check_quiescent, check_state)
from fz3.core.spec import build_spec
from fz3.core.param.state import (AVAILABLE, INFLIGHT, NOT_AVAILABLE, Inflight, ModuleSlot, ParamSlot,
                            ParamState, initial_state)

# a (3) is persistent (threshold 3), b (4) and c (5) are not; blk owns a and b.
SPEC = build_spec([("a", 3), ("b", 4), ("c", 5)],
                  [("root", [], False), ("blk", [0, 1], False), ("tail", [2], False)],
                  world_size=1, persistence_threshold=3)
A, B, C = 0, 1, 2
ROOT, BLK, TAIL = 0, 1, 2
NUMEL = (3, 4, 5)


def P(status, handle=None, users=0, external=False):
    """A param slot."""
    return ParamSlot(status, handle, users, -1, external)


def M(pre_backward=0, grads_remaining=0, active=0, externals=()):
    """A module slot."""
    return ModuleSlot(pre_backward, grads_remaining, -1, active, externals)


def state(params=None, modules=None, inflight=(), live=None, held=()) -> ParamState:
    """initial_state with `params` / `modules` ({id: row}) replaced; live_numel defaults to the
    numel of the params not NOT_AVAILABLE (so it is right unless a test says otherwise)."""
    st = initial_state(SPEC)
    st = st.with_slots(params, modules)._replace(
        inflight=tuple(Inflight(h, tuple(ps)) for h, ps in inflight), held=held)
    if live is None:
        live = sum(NUMEL[p] for p in range(len(NUMEL)) if st.status(p) != NOT_AVAILABLE)
    return st._replace(live_numel=live)


# ---- check_state ---------------------------------------------------------------------------------

@pytest.mark.parametrize("st, msg", [
    (state({A: P(INFLIGHT, 0), B: P(INFLIGHT, 1), C: P(INFLIGHT, 2)},
           inflight=[(0, [A]), (1, [B]), (2, [C])]),
     "3 gathers in flight, at most 2 allowed"),
    (state({B: P(INFLIGHT, 7)}),  # its handle is not in flight at all
     "param b is INFLIGHT on handle 7, which is not in flight with it"),
    (state({A: P(INFLIGHT, 0), B: P(INFLIGHT, 0)}, inflight=[(0, [A])]),  # in flight, without b
     "param b is INFLIGHT on handle 0, which is not in flight with it"),
    (state({A: P(AVAILABLE, 3)}), "param a is AVAILABLE but still holds handle 3"),
    (state({C: P(NOT_AVAILABLE, 3)}), "param c is NOT_AVAILABLE but still holds handle 3"),
    (state({B: P(NOT_AVAILABLE, users=1)}, {BLK: M(active=1)}),
     "param b has 1 active users but is NOT_AVAILABLE"),
    (state({A: P(AVAILABLE, users=1), B: P(INFLIGHT, 0, users=1)}, {BLK: M(active=1)},
           inflight=[(0, [B])]),
     "param b has 1 active users but is INFLIGHT"),
    (state({A: P(AVAILABLE)}, inflight=[(0, [A])]),
     "handle 0 is in flight but carries a, which is AVAILABLE"),
    (state({A: P(INFLIGHT, 0), C: P(NOT_AVAILABLE)}, inflight=[(0, [A, C])]),
     "handle 0 is in flight but carries c, which is NOT_AVAILABLE"),
    (state({C: P(AVAILABLE, users=1)}), "param c counts 1 users, but 0 active"),  # no module
    (state({A: P(AVAILABLE, users=1), B: P(AVAILABLE)}, {BLK: M(active=1)}),
     "param b counts 0 users, but 1 active"),  # blk is active, b does not count it
    (state({C: P(AVAILABLE, users=1)}, held=(C, C)), "param c counts 1 users, but 2 active"),
    (state(live=5), "live numel is 5 but the gathered params add up to 0"),
    (state({B: P(AVAILABLE), C: P(INFLIGHT, 0)}, inflight=[(0, [C])], live=4),
     "live numel is 4 but the gathered params add up to 9"),  # in flight counts as live
    (state(modules={BLK: M(pre_backward=-1)}),
     r"module blk has negative counters ModuleSlot\(pre_backward=-1, grads_remaining=0"),
    (state(modules={TAIL: M(grads_remaining=-1)}),
     r"module tail has negative counters ModuleSlot\(pre_backward=0, grads_remaining=-1"),
])
def test_check_state_catches(st, msg):
    with pytest.raises(InvariantError, match=msg):
        check_state(st)


@pytest.mark.parametrize("st", [
    initial_state(SPEC),  # counters at 0, nothing live
    state({A: P(INFLIGHT, 0), B: P(INFLIGHT, 0), C: P(INFLIGHT, 1)},
          inflight=[(0, [A, B]), (1, [C])]),  # MAX_INFLIGHT = 2 gathers
    state({A: P(AVAILABLE, users=1), B: P(AVAILABLE, users=1)}, {BLK: M(1, 1, active=1)}),
    state({A: P(AVAILABLE, users=2), B: P(AVAILABLE, users=1)}, {BLK: M(active=2)},
          held=(A,)),  # active counts once however many calls are open; a hold counts
    state({C: P(AVAILABLE, users=1, external=True)}, {ROOT: M(active=1, externals=(C,))}),
])
def test_check_state_passes_at_the_bounds(st):
    check_state(st)


# ---- check_fetched -------------------------------------------------------------------------------

@pytest.mark.parametrize("st, msg", [
    (state({A: P(NOT_AVAILABLE, users=1), B: P(AVAILABLE, users=1)}, {BLK: M(active=1)}),
     r"module blk computes with param a, which is NOT_AVAILABLE with 1 users \(module active: 1\)"),
    (state({A: P(AVAILABLE, users=1), B: P(INFLIGHT, 0, users=1)}, {BLK: M(active=1)},
           inflight=[(0, [B])]),
     r"module blk computes with param b, which is INFLIGHT with 1 users \(module active: 1\)"),
    (state({A: P(AVAILABLE, users=1), B: P(AVAILABLE, users=1)}, {BLK: M(active=0)}),
     r"module blk computes with param a, which is AVAILABLE with 1 users \(module active: 0\)"),
    (state({A: P(AVAILABLE, users=1), B: P(AVAILABLE, users=0)}, {BLK: M(active=1)}),
     r"module blk computes with param b, which is AVAILABLE with 0 users \(module active: 1\)"),
])
def test_check_fetched_catches(st, msg):
    with pytest.raises(InvariantError, match=msg):
        check_fetched(st, BLK)


def test_check_fetched_passes_for_an_active_module_with_its_params_available():
    st = state({A: P(AVAILABLE, users=1), B: P(AVAILABLE, users=1),
                C: P(AVAILABLE, users=1, external=True)},
               {BLK: M(active=1, externals=(C,))})
    check_fetched(st, BLK)
    check_fetched(st, ROOT)  # owns nothing
    with pytest.raises(InvariantError, match="module tail computes with param c, which is "
                                             r"AVAILABLE with 1 users \(module active: 0\)"):
        check_fetched(st, TAIL)


# ---- check_live_budget ---------------------------------------------------------------------------

PREFETCH = (AllGather(0, (B, C), True, True),)


def test_check_live_budget_catches_a_prefetch_past_the_budget():
    after = state({B: P(INFLIGHT, 0), C: P(INFLIGHT, 0)}, inflight=[(0, [B, C])])
    with pytest.raises(InvariantError, match="prefetch left 9 elements live, over "
                                             "max_live_parameters=8"):
        check_live_budget(after, PREFETCH, config=Config(max_live_parameters=8))


def test_check_live_budget_passes_at_the_budget_and_without_a_prefetch():
    after = state({B: P(INFLIGHT, 0), C: P(INFLIGHT, 0)}, inflight=[(0, [B, C])])
    check_live_budget(after, PREFETCH, config=Config(max_live_parameters=9))  # live == budget
    demand = (AllGather(0, (B, C), False, True), Wait(0), Free((A,)))  # on demand: not bound
    check_live_budget(after, demand, config=Config(max_live_parameters=8))


# ---- check_prefetch_reach ------------------------------------------------------------------------

def ahead_state(marks: dict, now: int = 2) -> ParamState:
    """b and c in flight on handle 0, each marked fetched for the step in `marks` (a gathered too,
    marked likewise if in `marks`); the latest fetch was at step `now`."""
    rows = {p: ParamSlot(INFLIGHT if p != A else AVAILABLE, 0 if p != A else None, 0, t, False)
            for p, t in marks.items()}
    st = state(rows, inflight=[(0, [p for p in marks if p != A])])
    return st._replace(trace=st.trace._replace(step_id=now + 1))


def test_check_prefetch_reach_catches_more_than_a_bucket_gathered_ahead():
    after = ahead_state({B: 3, C: 4})
    with pytest.raises(InvariantError, match=r"prefetch left 9 elements gathered ahead of step 2 \(b, c\), "
                                             "more than prefetch_bucket_size=3 plus one param"):
        check_prefetch_reach(after, PREFETCH, config=Config(prefetch_bucket_size=3))


def test_check_prefetch_reach_passes_at_the_bound_and_counts_only_what_is_ahead():
    check_prefetch_reach(ahead_state({B: 3, C: 4}), PREFETCH, config=Config(prefetch_bucket_size=4))
    # b's mark is the latest fetch's (in use now, not ahead); a persists with a mark from an
    # earlier pass; neither counts
    check_prefetch_reach(ahead_state({A: 9, B: 2, C: 4}), PREFETCH, config=Config(prefetch_bucket_size=0))
    demand = (AllGather(0, (B, C), False, True),)  # no prefetch: not bound
    check_prefetch_reach(ahead_state({B: 3, C: 4}), demand, config=Config(prefetch_bucket_size=0))


# ---- check_quiescent -----------------------------------------------------------------------------

@pytest.mark.parametrize("st, msg", [
    (state({B: P(INFLIGHT, 0), C: P(INFLIGHT, 1)}, inflight=[(0, [B]), (1, [C])]),
     r"gathers still in flight after the pass: \[0, 1\]"),
    (state({B: P(AVAILABLE)}), r"param b is AVAILABLE after the pass \(not persistent, not external"),
    (state({B: P(AVAILABLE), C: P(AVAILABLE, users=1)}, held=(C,)),  # c is held, b is not
     r"param b is AVAILABLE after the pass \(not persistent, not external"),
    (state({A: P(AVAILABLE, users=1)}), r"param a still has 1 users after the pass \(0 holds\)"),
    (state({C: P(AVAILABLE, users=1)}, held=(C, C)),
     r"param c still has 1 users after the pass \(2 holds\)"),
    (state(modules={BLK: M(pre_backward=1)}),
     "module blk has pre_backward=1, grads_remaining=0 after the pass"),
    (state(modules={TAIL: M(grads_remaining=2)}),
     "module tail has pre_backward=0, grads_remaining=2 after the pass"),
])
def test_check_quiescent_catches(st, msg):
    with pytest.raises(InvariantError, match=msg):
        check_quiescent(st)


@pytest.mark.parametrize("st", [
    initial_state(SPEC),
    state({A: P(AVAILABLE)}),  # persistent
    state({B: P(AVAILABLE, external=True)}),  # external
    state({C: P(AVAILABLE, users=2)}, held=(C, C)),  # held twice by an open gathered_parameters
])
def test_check_quiescent_passes_for_what_may_stay(st):
    check_quiescent(st)
