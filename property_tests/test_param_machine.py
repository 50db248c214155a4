"""Hypothesis proof of the parameter lifecycle (issue #2): I1, I2, I5, I6 on generated models.

    TestParamLifecycle   the state machine (fz3/testing/param_machine.py): every invariant after
                         every event, against a naive model
    the rest             targeted properties: prefetch is not vacuous, an order change
                         invalidates once, a repeated program never does, configs change timing
                         and never what is computed (I5), two processes emit the same effects (I6)
    NESTED               a parent and its child sharing a param: the keep rule's regression

    CI=1 pytest property_tests/test_param_machine.py      # the ci profile, derandomized
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from fz3.config.config import Config
from fz3.core.effects import AllGather
from fz3.core.ids import TraceMode
from fz3.testing.models import (HUGE, Call, Case, External, Model, cases, configs,
                                generous_configs, models, programs, variants)
from fz3.testing.param_events import BackwardFetch, Fetch
from fz3.testing.param_machine import ParamLifecycleMachine, run_passes

TestParamLifecycle = ParamLifecycleMachine.TestCase
TestParamLifecycle.settings = settings(stateful_step_count=20)


def gathers(entries: list[tuple[tuple, tuple]]) -> list[tuple[int, AllGather]]:
    """(event index, AllGather) in a pass's [(event, effects)]."""
    return [(i, e) for i, (_, effs) in enumerate(entries) for e in effs if isinstance(e, AllGather)]


def fetch_order(entries: list[tuple[tuple, tuple]]) -> list[int]:
    """The modules fetched in a complete pass, forward then backward: what the trace records."""
    return [ev.module for ev, _ in entries if type(ev) in (Fetch, BackwardFetch)]


@st.composite
def model_and_program(draw, config=None):
    model = draw(models())
    return Case(model, draw(config if config is not None else generous_configs()), (draw(programs(model)),))


@given(model_and_program())
def test_prefetch_happens_once_the_trace_is_complete(case):
    """Generous config, a program repeated: in a COMPLETE pass the root's fetch prefetches every
    param the rest of the pass needs; with a huge reuse distance nothing is fetched on demand
    after it (prefetched and tied params are kept until their use)."""
    machine, passes = run_passes(case, [(0, "complete")] * 3)
    third = passes[2]
    assert machine.state.trace.mode is TraceMode.COMPLETE and machine.state.trace.invalidations == 0
    naive, order = machine.model, fetch_order(third)
    needed = set().union(*(naive.unit(m) for m in order[1:])) - naive.unit(order[0])
    needed -= naive.persistent | naive.external()
    first = next(i for i, (ev, _) in enumerate(third) if type(ev) is Fetch)
    prefetched = {p for i, g in gathers(third) if g.prefetch and i == first for p in g.params}
    assert prefetched == needed
    if case.config.max_reuse_distance == HUGE:
        late = [(i, g) for i, g in gathers(third) if i != first]
        assert not late, f"gathers after the first fetch: {late}"


@st.composite
def base_and_variant(draw):
    model = draw(models())
    base = draw(programs(model))
    return Case(model, draw(generous_configs()), (base, draw(variants(model, base))))


@given(base_and_variant())
def test_order_change_invalidates_once(case):
    """base, base (-> COMPLETE), variant: the trace invalidates exactly once iff the variant's
    fetch order departs from the base's (or it registers new external params), and records the
    variant's order as the next plan."""
    machine, passes = run_passes(case, [(0, "complete"), (0, "complete")])
    before = {m: set(ps) for m, ps in machine.model.externals.items()}
    assert machine.state.trace.mode is TraceMode.COMPLETE
    variant = machine.run_pass(1, "complete")
    machine.run_pass(1, "complete")  # its reset closes the variant pass
    changed = before != machine.model.externals or fetch_order(variant) != fetch_order(passes[1])
    assert machine.state.trace.invalidations == int(changed)
    assert machine.state.trace.mode is (TraceMode.RECORD if changed else TraceMode.COMPLETE)
    machine.run_pass(1, "complete")
    assert machine.state.trace.mode is TraceMode.COMPLETE
    assert list(machine.state.trace.plan.order) == fetch_order(variant)


@given(model_and_program(config=configs()), st.integers(3, 6))
def test_repeated_program_stays_complete(case, n):
    """The same pass n times: RECORD, then COMPLETE for good, one plan, no invalidation."""
    machine = ParamLifecycleMachine()
    machine.start(case)
    modes, plans = [], []
    for _ in range(n):
        machine.run_pass(0, "complete")
        modes.append(machine.state.trace.mode)
        plans.append(machine.state.trace.plan)
    assert modes == [TraceMode.RECORD] + [TraceMode.COMPLETE] * (n - 1)
    assert machine.state.trace.invalidations == 0
    assert all(p == plans[1] for p in plans[1:])


STINGY = Config(prefetch_bucket_size=0, max_live_parameters=0, max_reuse_distance=0,
                param_persistence_threshold=0)
SCHEDULES = st.lists(st.tuples(st.integers(0, 2), st.sampled_from(["complete", "partial", "step"])),
                     min_size=1, max_size=6)


@given(cases(), SCHEDULES)
def test_config_and_order_never_change_what_is_computed(case, schedule):
    """I5: the same passes under the drawn config and under a config with no prefetch, no reuse
    keeping and no budget find, at every compute, the same params AVAILABLE: the whole unit."""
    schedule = [(w % len(case.programs), k) for w, k in schedule]
    drawn, _ = run_passes(case, schedule)
    stingy, _ = run_passes(Case(case.model, STINGY.replace(
        param_persistence_threshold=case.config.param_persistence_threshold), case.programs),
        schedule)
    assert drawn.model.computed == stingy.model.computed


EXAMPLE = Case(  # the tied embedding / lm_head model, a conditional branch and an external param
    Model(2, (("emb.w", 12), ("l1.w", 6), ("l1.b", 1), ("l2.w", 6), ("l2.b", 1), ("norm", 0)),
          (("", (5,), False), ("emb", (0,), False), ("l1", (1, 2), False), ("l2", (3, 4), False),
           ("head", (0,), False)), (1, 2, 3, 4)),
    Config(prefetch_bucket_size=7, max_live_parameters=20, max_reuse_distance=10,
           param_persistence_threshold=1),
    (Call(0, True, 0, (Call(1, True, 0), Call(2, True, 1), Call(3, True, 1), Call(4, True, 1))),
     Call(0, True, 0, (Call(1, True, 0), Call(3, True, 1, (Call(2, True, 1, returns=(2,)),)),
                       Call(4, True, 1))),
     Call(0, True, 0, (Call(1, True, 0), Call(2, True, 1), Call(4, True, 1, (External((1,)),))))),
)
SCHEDULE = ([(0, "complete")] * 3 + [(1, "complete"), (2, "complete"), (0, "partial"), (0, "step")]
            + [(0, "complete")] * 3)


def effect_log() -> list[str]:
    """EXAMPLE's effects over SCHEDULE, as strings (for the cross-process comparison)."""
    _, passes = run_passes(EXAMPLE, SCHEDULE)
    return [repr(e) for entries in passes for _, effs in entries for e in effs]


def test_two_processes_emit_the_same_effects():
    """I6 across processes: ranks are separate interpreters with their own hash seeds; the core
    must not let set or dict order leak into the effect order."""
    code = ("import json; from property_tests.test_param_machine import effect_log; "
            "print(json.dumps(effect_log()))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs = [subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ, PYTHONHASHSEED=seed),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=root)
            for seed in ("1", "2")]
    logs = []
    for run in runs:
        out, err = run.communicate(timeout=120)
        assert run.returncode == 0, err[-2000:]
        logs.append(json.loads(out))
    assert logs[0] == logs[1] == effect_log()
    assert any("prefetch=True" in e for e in logs[0])


NESTED = Case(  # a root and its child share (tie) one param; no reuse distance, no prefetch
    Model(1, (("w", 4),), (("", (0,), False), ("child", (0,), False)), (1,)),
    Config(prefetch_bucket_size=0, max_reuse_distance=0, param_persistence_threshold=0),
    (Call(0, True, 0, (Call(1, True, 0),)),))


def test_release_keeps_by_the_documented_rule():
    """Liveness under the rule in words: the root's forward release frees w (max_reuse_distance
    0 keeps nothing for reuse, and w was not prefetched; the child's fetch marked it, which kept
    it until the core compared the mark with the latest fetch's step: [Note: fetch marks])."""
    run_passes(NESTED, [(0, "complete")] * 3)
