"""The replay as a differential machine: every event of the calls machine's drawn streams goes
through `events.update` (the reference, checked as CallsMachine checks it) and through the
replay (fz3/core/replay.py), and the two must agree event by event: the same effects, the same
state (the replay's made exact with `current`).

    steady        the last pass again, several times: the trace completes, a pass is recorded,
                  the next ones are answered from its schedule, linked pass to pass
    (inherited)   one_pass and optimizer_step of CallsMachine: other programs, partial
                  backwards, eval passes, forwards that raise, skipped steps: departures from
                  a schedule at any event

After every event also, with the counters moved by a drawn `Shift` (backwards and windows
ahead of where the run is): `events.update` from the shifted state before the event gives the
same effects (SkipStep's step number moved with the windows) and the shifted state after it.
That is what lets one recorded pass serve every later step ([Note: a pass forgets]).

Reuse:  from fz3.testing.replay_machine import ReplayMachine
        TestReplay = ReplayMachine.TestCase
"""
from __future__ import annotations

import fz3.testing.extra  # noqa: F401 - Hypothesis, or an ImportError naming the test extra
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule

from fz3.core import events as core_events
from fz3.core import replay
from fz3.core.events import Resumed
from fz3.core.hook_effects import SkipStep
from fz3.testing.calls_machine import CallsMachine, snapshot
from fz3.testing.coverage import covered
from fz3.testing.models import Case
from fz3.testing.call_cases import call_cases


class ReplayMachine(CallsMachine):
    """CallsMachine with the replay beside `update`; see the module docstring."""

    shift = replay.Shift(3, 2)

    @initialize(case=call_cases(), shift=st.tuples(st.integers(0, 5), st.integers(0, 3)))
    def setup(self, case: Case, shift: tuple[int, int]) -> None:
        note(f"case: {case}, shift {shift}")
        self.shift = replay.Shift(*shift)
        self.start(case)
        covered("examples", "replay")

    def start(self, case: Case) -> None:
        super().start(case)
        self.cell = replay.start(self.state)

    def fire(self, event) -> tuple:
        before = self.state
        effects = super().fire(event)
        self.check_shifted(before, event, effects)
        played_before = self.cell.playing is not None
        self.cell, got = replay.advance(self.cell, event, config=self.config)
        assert got == effects, f"replay answered {event!r} with {got}, update gives {effects}"
        assert snapshot(replay.current(self.cell)) == snapshot(self.state), (
            f"replay: the state after {event!r} is not update's")
        if self.cell.playing is not None:
            covered("replay", "event answered from a schedule")
            if replay.starts_pass(event):
                covered("replay", "pass started on a schedule" + (" (linked)" if played_before else ""))
        elif played_before:
            covered("replay", "departure from a schedule")
        return effects

    def check_shifted(self, before, event, effects: tuple) -> None:
        """`update` commutes with a Shift ([Note: a pass forgets]); Resumed sets the counters."""
        if type(event) is Resumed:
            return
        d = self.shift
        after, moved = core_events.update(replay.shifted(before, d), event, config=self.config)
        want = tuple(SkipStep(e.step + d.window) if type(e) is SkipStep else e for e in effects)
        assert moved == want, f"shifted by {d}: {event!r} gave {moved}, not {want}"
        assert snapshot(after) == snapshot(replay.shifted(self.state, d)), (
            f"shifted by {d}: the state after {event!r} is not the shifted state")
        covered("replay", "update commutes with a shift")

    @rule(times=st.integers(2, 5))
    def steady(self, times: int) -> None:
        """The last pass `times` times more (a first one if none ran)."""
        if self.last is None:
            self.last = 0, "complete", None
        self.passes_of(*self.last, times)
