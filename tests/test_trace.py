"""The trace machine and its plan (fz3/core/param/trace.py), alone and through fetch.

    INVALID --reset--> RECORD --reset--> COMPLETE --(pass matched)--> COMPLETE
       ^-------------- departure / pass ended early ---------------------+
"""
from __future__ import annotations

import pytest

from fz3.core.param.backward import register_external
from fz3.config.config import Config
from fz3.core.param.fetch import fetch
from fz3.core.ids import TraceMode
from fz3.core.param.step import reset_step
from fz3.core.param.trace import UNIT_GREW, build_plan, initial_trace, invalidated, on_fetch, pass_kind, reset
from tests.support.driver import Driver

UNITS = {0: (), 1: (0,), 2: (1, 2), 3: (0,)}  # root, emb, l1, head (tied emb.w)
NUMEL = {0: 100, 1: 50, 2: 5}


def run(tr, modules):
    """Fetch `modules` in order; -> (trace, departures)."""
    departed = []
    for m in modules:
        tr, d = on_fetch(tr, m)
        departed.append(d)
    return tr, departed


def new_pass(tr, reuse=10**9):
    return reset(tr, UNITS.__getitem__, NUMEL.__getitem__, reuse)


def test_initial_record_complete():
    tr = initial_trace()
    assert tr.mode is TraceMode.INVALID and tr.plan is None
    tr = new_pass(tr)
    assert tr.mode is TraceMode.RECORD
    tr, departed = run(tr, [0, 1, 2, 3])
    assert departed == [False] * 4 and list(tr.recording) == [0, 1, 2, 3]
    tr = new_pass(tr)
    assert tr.mode is TraceMode.COMPLETE and tr.plan.order == (0, 1, 2, 3)
    assert (tr.step_id, list(tr.recording), tr.cursor, tr.invalidations) == (0, [], 0, 0)


def test_initial_trace_is_empty_and_invalid():
    """Before the first pass: no plan, nothing logged, cursor 0, no departure, of the given kind."""
    for kind, tr in (("train", initial_trace()), ("eval", initial_trace("eval"))):
        assert (tr.mode, tr.step_id, list(tr.recording), tr.plan, tr.cursor, tr.invalidations, tr.kind,
                tr.parked, tr.departure) == (TraceMode.INVALID, 0, [], None, 0, 0, kind, (), ())


def complete():
    tr, _ = run(new_pass(initial_trace()), [0, 1, 2, 3])
    return new_pass(tr)


# (this pass's fetches, departure flags, mode after the pass, after its reset, invalidations)
PASSES = [
    ("the same order", [0, 1, 2, 3], [False] * 4, TraceMode.COMPLETE, TraceMode.COMPLETE, 0),
    ("another module", [0, 2], [False, True], TraceMode.COMPLETE, TraceMode.RECORD, 1),
    ("one fetch too many", [0, 1, 2, 3, 3], [False] * 4 + [True], TraceMode.COMPLETE,
     TraceMode.RECORD, 1),
    ("ended early", [0, 1], [False, False], TraceMode.COMPLETE, TraceMode.RECORD, 1),
    ("no fetch at all", [], [], TraceMode.COMPLETE, TraceMode.COMPLETE, 0),
]


@pytest.mark.parametrize("why,order,flags,during,after,invalidations", PASSES,
                         ids=[p[0] for p in PASSES])
def test_pass_against_plan(why, order, flags, during, after, invalidations):
    tr, departed = run(complete(), order)
    assert departed == flags
    assert tr.mode is during  # on_fetch only reports; fetch invalidates
    if any(departed):
        tr = invalidated(tr)
        assert tr.mode is TraceMode.INVALID and tr.plan is None
    tr = new_pass(tr)
    assert (tr.mode, tr.invalidations) == (after, invalidations)


def test_record_pass_without_fetches_keeps_recording():
    tr = new_pass(new_pass(initial_trace()))
    assert tr.mode is TraceMode.RECORD and tr.plan is None


def test_build_plan_queue_and_steps():
    plan = build_plan((0, 1, 2, 3), UNITS.__getitem__, NUMEL.__getitem__, 10**9)
    assert plan.queue == ((1, 0), (2, 1), (2, 2), (3, 0))
    assert plan.step_start == (0, 0, 1, 3, 4)
    assert plan.reused == ((), (0,), (), ())


# max_reuse_distance -> is emb.w (step 1) reused at head (step 3)? l1's 55 elements lie between
@pytest.mark.parametrize("distance,reused", [(0, False), (55, False), (56, True), (10**9, True)])
def test_reuse_distance_is_strict(distance, reused):
    plan = build_plan((0, 1, 2, 3), UNITS.__getitem__, NUMEL.__getitem__, distance)
    assert (0 in plan.reused[1]) is reused


def test_adjacent_reuse_needs_a_positive_distance():
    """Nothing between two uses: the gap is 0, reused iff 0 < distance."""
    units = {0: (0,), 1: (0,)}
    assert build_plan((0, 1), units.__getitem__, NUMEL.__getitem__, 0).reused[0] == ()
    assert build_plan((0, 1), units.__getitem__, NUMEL.__getitem__, 1).reused[0] == (0,)


def test_reuse_looks_at_the_next_use_only():
    """emb.w used at steps 0, 2, 3: step 0 looks at step 2, step 2 at step 3."""
    units = {0: (0,), 1: (1,), 2: (0,)}
    plan = build_plan((0, 1, 2, 2), units.__getitem__, NUMEL.__getitem__, 51)
    assert plan.reused == ((0,), (), (0,), ())


CFG = Config(prefetch_bucket_size=0, param_persistence_threshold=0)
MODEL = ([("a", 4), ("b", 4)], [("", [], False), ("a", [0], False), ("b", [1], False)])


def test_fetch_departure_invalidates_through_the_core():
    d = Driver(*MODEL, config=CFG)
    for order in ([1, 2], [1, 2], [2, 1], [2, 1], [2, 1]):
        d(reset_step)
        for m in [0] + order:
            d(fetch, m, forward=True)
    # RECORD [1,2]; COMPLETE [1,2]; [2,1] departs; RECORD [2,1]; COMPLETE [2,1]
    assert d.st.trace.mode is TraceMode.COMPLETE and d.st.trace.invalidations == 1
    assert d.st.trace.plan.order == (0, 2, 1)


def test_new_external_param_invalidates_a_complete_trace():
    d = Driver(*MODEL, config=CFG)
    for _ in range(2):
        d(reset_step)
        d(fetch, 0, forward=True)
    assert d.st.trace.mode is TraceMode.COMPLETE
    d(register_external, 0, (1,))
    assert d.st.trace.mode is TraceMode.INVALID and d.st.trace.invalidations == 1
    d(register_external, 0, (1,))  # known already: nothing changes
    assert d.st.trace.invalidations == 1


# ---- pass kinds and aborted passes --------------------------------------------------------------

def test_pass_kind_by_grad_and_train_mode():
    kinds = {pass_kind(g, t) for g in (True, False) for t in (True, False)}
    assert len(kinds) == 4 and pass_kind(True, True) == "train"


def test_alternating_kinds_keep_both_plans():
    """Train passes fetch forward + backward, eval passes forward only: each kind keeps its
    own plan, so alternating them never departs (DeepSpeed #5662)."""
    train, evaluate = [0, 1, 2, 3, 3, 2, 1], [0, 1, 2, 3]
    tr = initial_trace()
    for _ in range(3):
        tr = reset(tr, UNITS.__getitem__, NUMEL.__getitem__, 10**9, kind="train")
        tr, _ = run(tr, train)
        tr = reset(tr, UNITS.__getitem__, NUMEL.__getitem__, 10**9, kind="eval_no_grad")
        tr, _ = run(tr, evaluate)
    assert tr.kind == "eval_no_grad" and tr.mode is TraceMode.COMPLETE and tr.plan.order == tuple(evaluate)
    parked = dict(tr.parked)
    assert parked["train"].mode is TraceMode.COMPLETE and parked["train"].plan.order == tuple(train)
    tr = reset(tr, UNITS.__getitem__, NUMEL.__getitem__, 10**9, kind="train")
    assert tr.mode is TraceMode.COMPLETE and tr.plan.order == tuple(train) and tr.invalidations == 0
    assert dict(tr.parked)["eval_no_grad"].plan.order == tuple(evaluate)


def test_invalidations_count_over_every_kind():
    tr = complete()  # train: COMPLETE [0, 1, 2, 3]
    tr, _ = run(tr, [0, 2])  # ended early: 1 when closed
    tr = reset(tr, UNITS.__getitem__, NUMEL.__getitem__, 10**9, kind="eval")
    tr, _ = run(tr, [0])
    tr = reset(tr, UNITS.__getitem__, NUMEL.__getitem__, 10**9, kind="eval")  # eval COMPLETE [0]
    tr, departed = run(tr, [1])
    assert departed == [True]
    tr = invalidated(tr)  # what fetch does on a departure: 2
    assert tr.invalidations == 2
    tr = reset(tr, UNITS.__getitem__, NUMEL.__getitem__, 10**9, kind="train")
    assert tr.invalidations == 2 and tr.kind == "train"


@pytest.mark.parametrize("mode_before", ["record", "complete"])
def test_an_aborted_pass_is_forgotten(mode_before):
    """A forward that raised after two fetches: RECORD stays RECORD (its partial log is not
    frozen into a plan), COMPLETE keeps its plan; neither counts a departure."""
    tr = new_pass(initial_trace()) if mode_before == "record" else complete()
    tr, _ = run(tr, [0, 1])
    tr = reset(tr, UNITS.__getitem__, NUMEL.__getitem__, 10**9, aborted=True)
    expected = TraceMode.RECORD if mode_before == "record" else TraceMode.COMPLETE
    assert (tr.mode, tr.invalidations, tr.step_id, len(tr.recording)) == (expected, 0, 0, 0)
    if mode_before == "complete":
        assert tr.plan.order == (0, 1, 2, 3)


def test_pass_kind_names_are_the_documented_ones():
    """docs/architecture.md names the four kinds; they key the parked traces."""
    assert [pass_kind(g, t) for g, t in ((True, True), (True, False), (False, True), (False, False))] == [
        "train", "eval", "train_no_grad", "eval_no_grad"]
    assert [pass_kind(True, t, True) for t in (True, False)] == ["train_grad_inputs", "eval_grad_inputs"]
    assert pass_kind(False, True, True) == "train_no_grad"  # without grad mode nothing needs grad


# ---- departure: where the last invalidation happened --------------------------------------------

# (fetches against the plan [0, 1, 2, 3], departure after invalidated(tr, last fetch))
DEPARTURES = [
    ("another module", [0, 2], (1, 2, 1)),
    ("at the first fetch", [1], (0, 1, 0)),
    ("module 0 where the plan expected 1", [0, 0], (1, 0, 1)),
    ("past the end of the plan", [0, 1, 2, 3, 3], (4, 3, -1)),
]


@pytest.mark.parametrize("why,order,departure", DEPARTURES, ids=[d[0] for d in DEPARTURES])
def test_departure_names_fetch_index_module_and_expected(why, order, departure):
    """invalidated(tr, module) (externals off by default) records the index of the fetch that
    departed (on_fetch has counted it already), that module, and what the plan expected there
    (-1 past its end); it drops the plan and counts one invalidation."""
    tr, departed = run(complete(), order)
    assert departed[-1]
    tr = invalidated(tr, order[-1])
    assert (tr.mode, tr.plan, tr.invalidations, tr.departure) == (TraceMode.INVALID, None, 1, departure)
    assert tr.step_id == len(order) and list(tr.recording) == order  # the pass goes on logging


def test_departure_of_external_params_expects_externals():
    """A module that took params it does not own: its own fetch index, the module, UNIT_GREW."""
    tr, _ = run(complete(), [0, 1])
    tr = invalidated(tr, 1, externals=True)
    assert (tr.mode, tr.invalidations, tr.departure) == (TraceMode.INVALID, 1, (1, 1, UNIT_GREW))


def test_pass_ended_early_records_where_it_ended():
    """No module (-1): the index is the fetch count, the expected module the plan's next one,
    whether invalidated directly or by the reset that closes the short pass."""
    tr, _ = run(complete(), [0, 1])
    assert invalidated(tr).departure == (2, -1, 2)
    tr = new_pass(tr)
    assert (tr.mode, tr.invalidations, tr.departure) == (TraceMode.RECORD, 1, (2, -1, 2))


def test_invalidation_rewinds_the_prefetch_cursor():
    """The plan is gone, so is the queue position prefetch had reached."""
    tr, _ = run(complete(), [0, 2])
    tr = invalidated(tr._replace(cursor=3), 2)  # as prefetch leaves it after two fetches
    assert tr.cursor == 0


def test_departure_is_kept_until_the_next_invalidation():
    """Later fetches, resets (recording again, completing again) and an aborted pass all keep the
    last departure; an aborted reset still rewinds the cursor and keeps the plan."""
    tr, _ = run(complete(), [0, 2])
    tr = invalidated(tr, 2)
    tr, _ = run(tr, [3])
    assert tr.departure == (1, 2, 1)
    tr = new_pass(tr)
    assert (tr.mode, tr.departure) == (TraceMode.RECORD, (1, 2, 1))
    tr, _ = run(tr, [0, 1, 2, 3])
    tr = new_pass(tr)
    assert (tr.mode, tr.departure) == (TraceMode.COMPLETE, (1, 2, 1))
    tr, _ = run(tr, [0, 1])
    tr = reset(tr._replace(cursor=2), UNITS.__getitem__, NUMEL.__getitem__, 10**9, aborted=True)
    assert (tr.mode, tr.cursor, tr.invalidations, tr.departure) == (TraceMode.COMPLETE, 0, 1, (1, 2, 1))
    assert tr.plan.order == (0, 1, 2, 3) and tr.parked == ()


def test_an_aborted_pass_keeps_the_parked_traces():
    tr = complete()
    tr = reset(tr, UNITS.__getitem__, NUMEL.__getitem__, 10**9, kind="eval")
    tr, _ = run(tr, [0])
    tr = reset(tr, UNITS.__getitem__, NUMEL.__getitem__, 10**9, kind="eval", aborted=True)
    assert (tr.kind, tr.mode, tr.departure) == ("eval", TraceMode.RECORD, ())
    assert [k for k, _ in tr.parked] == ["train"] and tr.parked[0][1].plan.order == (0, 1, 2, 3)


def test_departure_follows_across_kinds():
    """Like `invalidations`, `departure` is the last one over every kind: a new kind takes it over
    from the trace it parks, not from its own parked trace."""
    tr, _ = run(complete(), [0, 2])
    tr = invalidated(tr, 2)  # train: (1, 2, 1)
    tr = reset(tr, UNITS.__getitem__, NUMEL.__getitem__, 10**9, kind="eval")
    assert (tr.kind, tr.mode, tr.departure, tr.invalidations) == ("eval", TraceMode.RECORD, (1, 2, 1), 1)
    tr, _ = run(tr, [0, 1])
    tr = reset(tr, UNITS.__getitem__, NUMEL.__getitem__, 10**9, kind="eval")  # eval COMPLETE [0, 1]
    tr, _ = run(tr, [3])
    tr = invalidated(tr, 3)  # eval: (0, 3, 0)
    tr = reset(tr, UNITS.__getitem__, NUMEL.__getitem__, 10**9, kind="train")
    assert (tr.kind, tr.departure, tr.invalidations) == ("train", (0, 3, 0), 2)


def test_parked_traces_hold_no_parked_traces():
    """Only the current trace holds the others: each parked one has parked == ()."""
    tr = complete()
    for kind in ("eval", "eval_no_grad"):
        tr = reset(tr, UNITS.__getitem__, NUMEL.__getitem__, 10**9, kind=kind)
        tr, _ = run(tr, [0])
    parked = dict(tr.parked)
    assert sorted(parked) == ["eval", "train"]
    assert parked["train"].parked == () and parked["eval"].parked == ()
