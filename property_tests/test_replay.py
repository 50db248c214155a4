"""The replay of steady-state passes (fz3/core/replay.py) against the full transitions, as a
Hypothesis machine (fz3/testing/replay_machine.py), and its teeth: a schedule that lost one Free
is caught.

    CI=1 pytest property_tests/test_replay.py
"""
from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from fz3.core import replay
from fz3.core.effects import Free
from fz3.testing.replay_machine import ReplayMachine

TestReplayMachine = ReplayMachine.TestCase
# each example builds a model and runs a dozen passes (0.9 s in CI, the suite's costliest machine):
# half the loaded profile's examples (ci 50, nightly 1000) keeps the suite under 20 minutes
TestReplayMachine.settings = settings(stateful_step_count=12, max_examples=max(1, settings.default.max_examples // 2))

HUNT = settings(max_examples=100, stateful_step_count=10, derandomize=True, database=None,
                deadline=None, phases=(Phase.generate,), report_multiple_bugs=False,
                suppress_health_check=list(HealthCheck))


def test_a_schedule_that_drops_a_free_is_caught(monkeypatch):
    """Planted: every schedule kept loses the first Free of its pass."""
    real = replay.Schedule

    def lossy(id, before, events, after, effects):
        out, dropped = [], False
        for eff in effects:
            if not dropped and any(type(e) is Free for e in eff):
                i = next(i for i, e in enumerate(eff) if type(e) is Free)
                eff, dropped = eff[:i] + eff[i + 1:], True
            out.append(eff)
        return real(id, before, events, after, tuple(out))

    monkeypatch.setattr(replay, "Schedule", lossy)
    with pytest.raises(AssertionError) as info:
        run_state_machine_as_test(ReplayMachine, settings=HUNT)
    assert re.search(r"replay answered .* with .*, update gives", str(info.value)), str(info.value)


def test_a_shift_that_forgets_the_window_is_caught(monkeypatch):
    """Planted: `shifted` moves the backward counter but not the window: a replayed pass would
    write the wrong partitions (copy for add) after the first window."""
    real = replay.shifted
    monkeypatch.setattr(replay, "shifted", lambda st, d: real(st, replay.Shift(d.backward, 0)))
    with pytest.raises(AssertionError) as info:
        run_state_machine_as_test(ReplayMachine, settings=HUNT)
    assert re.search(r"shifted by|replay", str(info.value)), str(info.value)
