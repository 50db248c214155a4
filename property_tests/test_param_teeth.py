"""Teeth: the parameter machine must catch deliberately broken cores.

Each test monkeypatches one function of fz3.core at its use site (the core's modules import
names directly: `fetch_into` finds `prefetch` in fz3.core.param.fetch's globals) and asserts that the
machine fails, deterministically (derandomized, no database, generate phase only; each is
caught within the first ~55 examples of the 100 allowed, the liveness ones within ~125 of
300), and that the check meant for the bug is the one that fires. A machine that passes a broken core proves nothing; these keep it
honest. The patches touch the core's internals (Txn, row columns), so a refactor of the core
may need them rewritten: keep each one a few lines.

    CI=1 pytest property_tests/test_param_teeth.py
"""
from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

import fz3.core.param.backward as backward
import fz3.core.param.fetch as fetch
import fz3.core.param.release as release
import fz3.core.param.step as step
from fz3.core.param.state import INFLIGHT, NOT_AVAILABLE, unit_params
from fz3.testing import planted
from fz3.testing.models import HUGE
from fz3.testing.param_machine import ParamLifecycleMachine

HUNT = settings(max_examples=100, stateful_step_count=12, derandomize=True, database=None,
                deadline=None, phases=(Phase.generate,), report_multiple_bugs=False,
                suppress_health_check=list(HealthCheck))


def assert_caught(pattern: str, errors: tuple = (AssertionError,), examples: int = 100) -> None:
    """The machine fails with one of `errors` whose message matches `pattern`."""
    with pytest.raises(errors) as info:
        run_state_machine_as_test(ParamLifecycleMachine,
                                  settings=settings(HUNT, max_examples=examples))
    assert re.search(pattern, str(info.value)), f"caught by another check: {info.value}"


def test_prefetch_ignoring_live_budget_is_caught(monkeypatch):
    """(a) prefetch takes params past max_live_parameters: I1."""
    real = fetch.prefetch

    def greedy(tx, step_, *, forward, config):
        real(tx, step_, forward=forward, config=config.replace(max_live_parameters=HUGE))

    monkeypatch.setattr(fetch, "prefetch", greedy)
    assert_caught("max_live_parameters")


def test_release_ignoring_other_users_is_caught(monkeypatch):
    """(b) release frees its module's params even when another active module (e.g. a parent
    sharing a tied weight with the child it calls) or a gathered_parameters still uses them."""
    selfish = planted.release_ignoring_other_users  # fz3/testing/planted.py: verify --patch's example too
    monkeypatch.setattr(release, "release_into", selfish)
    monkeypatch.setattr(backward, "release_into", selfish)
    assert_caught("used by an active module|held by gathered_parameters")


def test_pre_backward_not_decrementing_is_caught(monkeypatch):
    """(c) the pre-backward ref count never goes down: the counters disagree with the model."""

    def sticky(st, module, *, config):
        if st.modules[module].pre_backward == 0:
            return st, ()
        return fetch.fetch(st, module, forward=False, config=config)

    monkeypatch.setattr(backward, "fetch_for_backward", sticky)
    assert_caught("counters")


def test_gather_of_inflight_param_is_caught(monkeypatch):
    """(d) a fetch gathers its params that a prefetch already has in flight, instead of
    waiting for them."""
    real = fetch.fetch_into

    def impatient(tx, module, *, forward, config, grad_inputs=0):
        pending = tuple(p for p in unit_params(tx, module) if tx.status(p) == INFLIGHT)
        if pending:
            fetch.gather(tx, pending, prefetch=False, forward=forward, fetched_for=(-1,) * len(pending))
        real(tx, module, forward=forward, config=config, grad_inputs=grad_inputs)

    monkeypatch.setattr(fetch, "fetch_into", impatient)
    monkeypatch.setattr(backward, "fetch_into", impatient)
    assert_caught("already INFLIGHT")


def test_trace_not_invalidated_on_departure_is_caught(monkeypatch):
    """(e) a pass leaves its plan and the COMPLETE trace keeps steering prefetch and release:
    the model's trace disagrees, or the stale plan runs off its end inside the core."""
    real = fetch.on_fetch

    def blind(tr, module):
        return real(tr, module)[0], False

    monkeypatch.setattr(fetch, "on_fetch", blind)
    assert_caught("trace|index out of range", (AssertionError, IndexError))


def test_reuse_keep_ignoring_live_budget_is_caught(monkeypatch):
    """(f) release keeps tied params for reuse whatever max_live_parameters says."""
    real = release._keep_for_reuse

    def hoard(tx, module, candidates, config):
        return real(tx, module, candidates, config.replace(max_live_parameters=HUGE))

    monkeypatch.setattr(release, "_keep_for_reuse", hoard)
    assert_caught("beyond active/persistent/external")


def test_counters_not_zeroed_at_pass_end_is_caught(monkeypatch):
    """(g) finish_backward / reset_step leave the counters of an incomplete backward."""
    monkeypatch.setattr(step, "_idle_modules", lambda tx: None)
    assert_caught("counters|open calls")


def test_transition_editing_its_input_is_caught(monkeypatch):
    """(h) a free that forgets to record the old rows: the state passed in changes under the
    caller (the persistent-array bookkeeping of pvec.py / Txn)."""
    real = release.free

    def leaky(tx, pids, refetch=False):
        real(tx, pids, refetch)
        for p in pids:
            tx._olds.pop(p, None)  # a planted bug reaches into the Txn on purpose

    monkeypatch.setattr(release, "free", leaky)
    assert_caught("changed the state it was given")


def test_one_trace_for_every_pass_kind_is_caught(monkeypatch):
    """(f) reset_step ignores the pass kind: a no_grad evaluation pass shares the training
    trace, so every switch between them departs from the plan (DeepSpeed #5662)."""
    monkeypatch.setattr(step, "pass_kind", lambda grad_enabled, training, grad_inputs=False: "train")
    assert_caught("trace")


def test_aborted_pass_recorded_as_a_plan_is_caught(monkeypatch):
    """(g) reset_step ignores `aborted`: a forward that raised freezes its partial recording
    into the plan (or counts as a departure)."""
    real = step.reset

    def remembers(tr, unit, numel, dist, *, kind, aborted):
        return real(tr, unit, numel, dist, kind=kind, aborted=False)

    monkeypatch.setattr(step, "reset", remembers)
    assert_caught("trace")


@pytest.mark.parametrize("always", [True, False])
def test_free_refetch_not_from_the_backward_count_is_caught(monkeypatch, always):
    """(i) Free.refetch ignores whether the releasing module's backward fetches it again: an
    interpreter would keep memory nothing takes (True) or drop what the backward needs (False)."""
    real = release.free

    def fixed(tx, pids, refetch=False):
        real(tx, pids, always)

    monkeypatch.setattr(release, "free", fixed)
    assert_caught("refetch should be")


# ---- liveness: conservative cores, safe but doing less than the trace's rules say -------------
# Only fz3/testing/naive_rules.py catches these: every effect is legal and every invariant holds
# (with the liveness check off, the machine passes each). They need a COMPLETE trace whose
# prefetch reaches far or whose plan reuses a param: 300 examples, a margin over the ~125 the
# last one takes.
LIVENESS_EXAMPLES = 300


def test_prefetch_stopping_one_param_early_is_caught(monkeypatch):
    """(j) the prefetch walk never takes the last param that fits (the one after which it would
    stop): that param is fetched on demand instead."""
    real = fetch.gather

    def timid(tx, pids, *, prefetch, forward, fetched_for):
        if prefetch:  # drop the walk's last pick: the queue is in (step, param) order
            last = max(range(len(pids)), key=lambda i: (fetched_for[i], pids[i]))
            rest = [i for i in range(len(pids)) if i != last]
            pids, fetched_for = tuple(pids[i] for i in rest), tuple(fetched_for[i] for i in rest)
            if not pids:
                return
        real(tx, pids, prefetch=prefetch, forward=forward, fetched_for=fetched_for)

    monkeypatch.setattr(fetch, "gather", timid)
    assert_caught(r"liveness: .* prefetched .*; the rules prefetch", examples=LIVENESS_EXAMPLES)


def test_release_keeping_nothing_for_reuse_is_caught(monkeypatch):
    """(k) `_keep_for_reuse` keeps nothing: tied and prefetched params the plan needs again
    soon are freed, and fetched again on demand."""
    monkeypatch.setattr(release, "_keep_for_reuse", lambda tx, module, candidates, config: [])
    assert_caught(r"liveness: .* freed .*; the rules free .* and keep", examples=LIVENESS_EXAMPLES)


def test_prefetch_never_past_the_next_step_is_caught(monkeypatch):
    """(l) the prefetch walk stops at the end of the next step's params, however much the bucket
    and the budget allow."""
    real = fetch.prefetch

    def short_sighted(tx, step_, *, forward, config):
        plan = tx.trace.plan
        end = plan.step_start[min(step_ + 2, len(plan.order))]
        tx.trace = tx.trace._replace(plan=plan._replace(queue=plan.queue[:end]))
        real(tx, step_, forward=forward, config=config)
        tx.trace = tx.trace._replace(plan=plan)

    monkeypatch.setattr(fetch, "prefetch", short_sighted)
    assert_caught(r"liveness: .* prefetched .*; the rules prefetch", examples=LIVENESS_EXAMPLES)


def _a_bucket_more(tx, step_, *, forward, config):
    """DeepSpeed's prefetch walk: from where the last one stopped, up to a bucket more."""
    tr = tx.trace
    i = reach = max(tr.cursor, tr.plan.step_start[step_ + 1])
    numel, end = 0, len(tr.plan.queue)
    while reach < end and numel < config.prefetch_bucket_size:  # DeepSpeed's batch
        p = tr.plan.queue[reach][1]
        if tx.status(p) == NOT_AVAILABLE:
            numel += tx.st.spec.params[p].numel
        reach += 1
    chosen, i = tx.not_available_fitting(tr.plan.queue, i, reach, config.max_live_parameters - tx.live)
    tx.trace = fetch.advanced(tr, i)
    if chosen:
        pids = tuple(sorted(chosen))
        fetch.gather(tx, pids, prefetch=True, forward=forward, fetched_for=tuple(chosen[p] for p in pids))


def test_prefetch_taking_a_bucket_more_at_every_fetch_is_caught(monkeypatch):
    """(m) DeepSpeed's rule instead of fz3's reach ([Note: prefetch bounds]): every fetch takes
    up to prefetch_bucket_size more, wherever the last prefetch left the queue, so what is
    gathered ahead grows to max_live_parameters."""
    monkeypatch.setattr(fetch, "prefetch", _a_bucket_more)
    assert_caught(r"liveness: .* prefetched .*; the rules prefetch", examples=LIVENESS_EXAMPLES)


def test_prefetch_past_its_reach_is_caught_by_the_invariant_alone(monkeypatch):
    """(n) the same planted walk, with the liveness rules silenced: check_prefetch_reach (the
    bound itself, also run by Options(debug_checks=True)) catches it by itself."""
    from fz3.testing import naive_rules
    monkeypatch.setattr(naive_rules.Liveness, "check", lambda self, effects, st: None)
    monkeypatch.setattr(fetch, "prefetch", _a_bucket_more)
    assert_caught(r"gathered ahead of step .* more than prefetch_bucket_size", examples=LIVENESS_EXAMPLES)


# ---- hpZ ([Note: hpZ], fz3/core/stage.py): the machine draws groups of 2 of 4 ranks -------------

def test_a_step_that_keeps_the_secondary_shards_is_caught(monkeypatch):
    """(o) the optimizer step leaves the secondary shards: the next backward would gather the
    old values within the hpZ group (DeepSpeed #5059-like: loss stuck on stale weights)."""
    monkeypatch.setattr(step, "with_secondary", lambda tx: [])
    assert_caught("stale secondary shards past the step|core says secondary shard")


def test_a_backward_that_gathers_its_shards_across_the_world_is_caught(monkeypatch):
    """(p) the backward ignores the secondary shards it has and gathers over the whole shard
    group: right values, but the traffic hpZ exists to keep on the node crosses it."""
    import fz3.core.param.state as state
    real = state.AllGather
    monkeypatch.setattr(state, "AllGather", lambda h, ps, pre, fwd, sec=(): real(h, ps, pre, fwd, ()))
    assert_caught("the params to gather from secondary shards are")


def test_a_release_that_keeps_no_secondary_shard_is_caught(monkeypatch):
    """(q) the forward's release marks the secondary shards kept but the Free never cuts them:
    the backward would gather shards nobody kept."""
    import fz3.core.param.state as state
    real = state.Free
    monkeypatch.setattr(state, "Free", lambda ps, refetch=False, sec=(): real(ps, refetch, ()))
    assert_caught("the secondary shards to keep are")
