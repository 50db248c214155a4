"""The parameter machine's events are records (fz3/testing/param_events.py): they print as
Python that rebuilds them, a drawn run replays to the same effects, and a failing machine prints
its events as a regression test that fails with the bug in and passes with it out."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

import fz3.core.param.release as release
from fz3.config.config import Config
from fz3.testing import param_events as pe
from fz3.testing.models import Call, Case, External, Model
from fz3.testing.param_machine import ParamLifecycleMachine, replay, run_passes

CONFIG = Config(prefetch_bucket_size=10, max_live_parameters=100, max_reuse_distance=10,
                param_persistence_threshold=0)
ALL = [pe.Fetch(2, 1), pe.Compute(2), pe.Register(0, (3, 4)), pe.Release(2, True), pe.BackwardFetch(2),
       pe.BackwardRelease(2), pe.Reset(False, True), pe.Finish(), pe.EndOfStep(), pe.HoldParams((1,)),
       pe.UnholdParams((1,), False)]

HUNT = settings(max_examples=200, stateful_step_count=12, deadline=None, database=None, derandomize=True,
                phases=(Phase.generate,), report_multiple_bugs=False, suppress_health_check=list(HealthCheck))


def test_events_print_as_python_and_differ_by_type():
    scope = vars(pe)
    for ev in ALL:
        assert eval(repr(ev), scope) == ev and type(eval(repr(ev), scope)) is type(ev)
    assert pe.Finish() != pe.EndOfStep() and pe.Compute(2) != pe.BackwardFetch(2)  # not as tuples
    assert len({ev.kind for ev in ALL}) == len(ALL)


def test_a_drawn_run_replays_to_the_same_effects():
    model = Model(2, (("a", 6), ("b", 4), ("c", 8)), (("root", (), False), ("x", (0, 1), False),
                                                       ("y", (2,), False)), (1, 2))
    program = Call(0, True, 1, body=(Call(1, True, 1), Call(2, True, 1, body=(External((0,)),))))
    case = Case(model, CONFIG, (program,))
    machine, passes = run_passes(case, [(0, "complete"), (0, "complete"), (0, "step"), (0, "partial")])
    events = [ev for entry in passes for ev, _ in entry]
    assert all(type(ev) in vars(pe).values() for ev in events)
    assert replay(case, events) == [effects for entry in passes for _, effects in entry]


def test_a_machine_failure_prints_a_regression_that_runs_and_fails(monkeypatch):
    """Plant a bug (a release frees nothing: its module's params stay gathered), let the
    machine find it, and run the Python it printed: it fails the same way while the bug is in,
    and passes once it is out."""
    real = release.free
    monkeypatch.setattr(release, "free", lambda tx, pids, refetch=False: None)
    with pytest.raises(AssertionError) as info:
        run_state_machine_as_test(ParamLifecycleMachine, settings=HUNT)
    first_line = str(info.value).splitlines()[0]
    printed = [n for n in getattr(info.value, "__notes__", []) if n.startswith("the events, as a regression test:")]
    assert printed, getattr(info.value, "__notes__", [])
    code = printed[-1].split("\n", 1)[1]
    print(code)
    assert "Fetch(module=" in code and "Release(module=" in code
    with pytest.raises(AssertionError) as again:
        exec(code, {})
    assert str(again.value).splitlines()[0] == first_line  # the same failure, from the pasted code
    monkeypatch.setattr(release, "free", real)
    scope: dict = {}
    exec(code, scope)  # the bug removed: the same events pass every check
    assert scope["effects"]
