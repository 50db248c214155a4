"""Events are records (fz3/core/events.py): a run's events replay through `update` to the same
effects, a failing machine prints its events as a regression test that runs, and `update`
refuses what is not an event."""
from __future__ import annotations

import re

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test
from torch import nn

import fz3
import fz3.core.calls as calls
from fz3 import launch
from fz3.core import events
from fz3.core.events import EVENTS, Enter, GradsZeroed, Leave, Resumed, StepCalled, Stepped, update
from fz3.core.hook_effects import WrapOutputs
from fz3.testing.calls_machine import CallsMachine
from fz3.testing.param_machine import snapshot as params_snapshot


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _run_and_replay(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 6), Block(), Block(), nn.Linear(6, 10))
    model[3].weight = model[0].weight  # tied: a param read by two modules
    model[1].a.bias.requires_grad_(False)  # a frozen param: its module's calls get PostBackward nodes
    engine = fz3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            fz3.Config(param_persistence_threshold=0, gradient_accumulation_steps=2,
                                       prefetch_bucket_size=100))
    log = []
    door = engine.update  # fz3/core/replay.py: passes answered from their recording

    def logged(cell, event, *, config):
        new, effects = door(cell, event, config=config)
        log.append((event, effects))
        return new, effects

    engine.update = logged  # the engine's one door (fz3.timeline times it the same way)
    start = engine.state
    ids = torch.randint(0, 10, (4, 5), generator=torch.Generator().manual_seed(rank))
    for _ in range(5):  # the trace completes (prefetch joins in), then passes come from schedules
        for _ in range(2):
            engine.backward(nn.functional.cross_entropy(engine(ids).flatten(0, 1), ids.flatten()))
            engine.step()
        with torch.no_grad():
            engine(ids)
    state, differ = start, []
    for event, effects in log:
        state, again = update(state, event, config=engine.config)
        if again != effects:
            differ.append(f"{event} replayed to {again}, the run got {effects}")
    return {"kinds": {type(e).__name__ for e, _ in log}, "differ": differ[:3],
            "replayed": engine.stats()["replayed_events"], "events": len(log),
            "same state": params_snapshot(state.params) == params_snapshot(engine.state.params),
            "windows": (state.grads.window, engine.state.grads.window)}


def test_a_runs_event_log_replays_through_update_to_the_same_effects():
    for out in launch.run_threads(_run_and_replay, 2):
        assert {"Enter", "Leave", "PreBackwardRan", "PostBackwardRan", "GradReady", "BackwardEnded",
                "Stepped"} <= out["kinds"]
        assert out["differ"] == []
        assert out["replayed"] > out["events"] // 3, out  # most steady-state passes came from a schedule
        assert out["same state"] and out["windows"] == (5, 5)


HUNT = settings(max_examples=100, stateful_step_count=12, derandomize=True, database=None, deadline=None,
                phases=(Phase.generate,), report_multiple_bugs=False, suppress_health_check=list(HealthCheck))


def test_a_machine_failure_prints_a_regression_that_runs_and_fails(monkeypatch):
    """Plant a bug (a call's outputs never get a PreBackward node), let the machine find it,
    and run the Python it printed: the regression fails the same way while the bug is in,
    and passes once it is out."""
    real = calls.leave

    def blind(st, ev, *, config):
        return real(st, ev._replace(grad_outputs=False), config=config)

    monkeypatch.setattr(calls, "leave", blind)
    with pytest.raises(AssertionError) as info:
        run_state_machine_as_test(CallsMachine, settings=HUNT)
    assert re.search(r"naive model: Leave.*expected \[WrapOutputs", str(info.value))
    printed = [n for n in getattr(info.value, "__notes__", []) if n.startswith("the events, as a regression test:")]
    code = printed[-1].split("\n", 1)[1]
    print(code)
    assert "Enter(module=" in code and "Leave(module=" in code
    with pytest.raises(AssertionError, match=r"naive model: Leave.*expected \[WrapOutputs"):
        exec(code, {})
    monkeypatch.setattr(calls, "leave", real)
    scope: dict = {}
    exec(code, scope)  # the bug removed: the same events pass every check
    assert any(WrapOutputs(e.module) in effects for e, effects in
               zip(_events(code), scope["effects"]) if isinstance(e, Leave) and e.grad_outputs)


def _events(code: str) -> list:
    scope: dict = {}
    exec(code.replace("effects = replay(", "case, evs = ("), scope)
    return scope["evs"]


def test_update_refuses_what_is_not_an_event():
    with pytest.raises(TypeError, match=r"update takes one of the events .*Enter, Read, Leave.*got \('enter', 0\)"):
        update(None, ("enter", 0), config=fz3.Config())


def test_every_event_prints_as_the_python_that_builds_it():
    from fz3.core.pvec import Log
    samples = [Enter(module=1, grad=True, grad_inputs=False, saved=3), Leave(module=1, grad_outputs=True, returned=(2,), saved=Log([4, 5])), Stepped(finite=False, leaf_grads=frozenset({3})),
               StepCalled(boundary=True), GradsZeroed(), Resumed(window=3, backward=7, skipped=1, micro_step=1)]
    for e in samples:
        assert eval(repr(e), vars(events) | {"Log": Log}) == e
    assert len(EVENTS) == len(set(EVENTS)) == 15


def test_events_are_built_and_read_by_keyword_everywhere_in_fz3():
    """Each event has one field list, its record's: no file of fz3 builds an event or matches one
    by position, so reordering a record's fields (four adjacent bools in Enter) cannot silently
    swap what the shell reports or what a step reads."""
    import ast
    import pathlib

    import fz3
    from fz3.core.events import EVENTS
    names = {e.__name__ for e in EVENTS}
    positional = []
    for f in sorted(pathlib.Path(fz3.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call):
                fn = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
                if fn in names and node.args:
                    positional.append(f"{f.name}:{node.lineno} {fn}(...) built by position")
            elif isinstance(node, ast.MatchClass):
                cls = node.cls.id if isinstance(node.cls, ast.Name) else getattr(node.cls, "attr", None)
                if cls in names and node.patterns:
                    positional.append(f"{f.name}:{node.lineno} case {cls}(...) read by position")
    assert not positional, "\n".join(positional)
