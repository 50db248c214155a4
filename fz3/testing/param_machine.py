"""The parameter lifecycle as a Hypothesis state machine: the real core against a naive model.

    initialize   draw a Case: a model, a config, a usual program and its conditional variants
    one_pass     reset_step, a forward (nested calls), then a backward that is complete, partial
                 (some calls' outputs get no grad), absent (eval under no_grad) or abandoned
                 (forward with grad, no backward), then finish_backward when there was one; or
                 a forward that raises midway (modules left active for the next reset_step).
                 reset_step says whether grad is enabled (a no_grad pass has its own trace)
                 and whether the last pass raised (its partial recording is dropped)
    step         end_of_step after a finished backward (gradient accumulation: sometimes not)
    gathered_parameters   enter or leave one around any of the above (nested at most twice)

After every event: check_state; the naive model (naive_params.py) executed the effects without
refusing one and agrees with the core field by field (statuses, handles, in-flight order, live
numel, users, counters, externals, trace); liveness: with a COMPLETE trace, each fetch's
prefetch and each release's Free are exactly what naive_rules.py predicts; I1 after a prefetch
and the live bound at all times; every active module finds its whole unit AVAILABLE; the
transition left the state it was given unchanged and, replayed from that (now older) version,
gives the same result (purity, over pvec.py's rerooting); and a twin core, built from its own
spec and fed the same events, emitted the same effects (I6). After finish_backward: I2
(check_quiescent, and for a complete backward the counters were 0 before it) and nothing
gathered in the pass leaked. I5: each `compute` finds its whole unit AVAILABLE, whatever the
trace mode (recorded in `computed`).

A failure prints, beside the log of its passes, its events from the start as a regression test
to paste: `replay(case, [Reset(...), Fetch(...), ...])` runs them with every check above and
returns each event's effects (the events are records: fz3/testing/param_events.py).

Reuse:  from fz3.testing.param_machine import ParamLifecycleMachine
        TestParams = ParamLifecycleMachine.TestCase
"""
from __future__ import annotations

import fz3.testing.extra  # noqa: F401 - Hypothesis, or an ImportError naming the test extra
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from fz3.core.param import backward as _backward
from fz3.core.param import fetch as _fetch
from fz3.core.param import hold as _hold
from fz3.core.param import invariants as _inv
from fz3.core.param import release as _release
from fz3.core.param import step as _step
from fz3.config.config import Config
from fz3.core.effects import AllGather
from fz3.core.param.state import ParamState, initial_state
from fz3.testing.coverage import covered
from fz3.testing.models import Case, Call, backward_events, cases, count_calls, forward_events
from fz3.testing.naive_params import NaiveParams
from fz3.testing.param_events import (BackwardFetch, BackwardRelease, Compute, EndOfStep, Fetch, Finish,
                                      HoldParams, Register, Release, Reset, UnholdParams)

BACKWARDS = ("complete", "complete", "complete", "partial", "none", "abandon", "raise")


def apply_event(st: ParamState, ev, config: Config) -> tuple[ParamState, tuple]:
    """Run one event record (fz3/testing/param_events.py) through the core. Looks functions up
    on their modules at call time, so a test may monkeypatch them (test_param_teeth.py does)."""
    match ev:
        case Fetch(m, grad_inputs):
            return _fetch.fetch(st, m, forward=True, config=config, grad_inputs=grad_inputs)
        case Release(m, grad_outputs):
            return _release.release(st, m, config=config, grad_outputs=grad_outputs)
        case Register(m, params):
            return _backward.register_external(st, m, params, config=config)
        case BackwardFetch(m):
            return _backward.fetch_for_backward(st, m, config=config)
        case BackwardRelease(m):
            return _backward.release_after_backward(st, m, config=config)
        case Reset(grad_enabled, aborted):
            return _step.reset_step(st, config=config, grad_enabled=grad_enabled, aborted=aborted)
        case Finish():
            return _step.finish_backward(st, config=config)
        case EndOfStep():
            return _step.end_of_step(st, config=config)
        case HoldParams(params):
            return _hold.hold(st, params, config=config)
        case UnholdParams(params, stale):
            return _hold.unhold(st, params, config=config, stale=stale)
        case Compute():
            return st, ()
    raise ValueError(f"unknown event {ev!r}")


def replay(case: Case, events: list) -> list[tuple]:
    """Run `events` (records, from the start of a case) through the core with every check of
    the machine on; -> each event's effects. What a failure prints as its regression test."""
    machine = ParamLifecycleMachine()
    machine.start(case)
    out = []
    for ev in events:
        out.append(machine.event(ev, []))
        if type(ev) is Finish:
            _inv.check_quiescent(machine.state)
    return out


def snapshot(st: ParamState) -> tuple:
    """Everything a state says, as plain values (its vectors read out)."""
    return (list(st.params), list(st.modules), st.live_numel, st.peak_live_numel, st.inflight,
            st.next_handle, list(st.gathered), st.trace, st.held)


def pass_events(program: Call, backward: str, detail: object = None) -> list:
    """The events of one pass: reset_step, the forward, then by `backward`:
        complete  every call's backward, finish_backward
        partial   the backward of the calls in `detail` (pre-order indices), finish_backward
        none      nothing (the forward ran under no_grad: eval)
        abandon   nothing (the forward ran with grad; no backward followed)
        raise     the forward stops after `detail` events (an exception), modules left active"""
    forward = forward_events(program, grad=backward != "none")
    if backward == "raise":
        return [Reset()] + forward[:detail]
    events = [Reset()] + forward
    if backward == "complete":
        events += backward_events(program) + [Finish()]
    elif backward == "partial":
        events += backward_events(program, detail or frozenset()) + [Finish()]
    return events


class ParamLifecycleMachine(RuleBasedStateMachine):
    """Drives fz3.core's parameter transitions through passes; see the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self.case: Case | None = None
        self.finished = False  # the last pass ran finish_backward: an optimizer step may follow

    @initialize(case=cases())
    def setup(self, case: Case) -> None:
        note(f"case: {case}")
        self.start(case)
        covered("examples", "parameter lifecycle")

    def start(self, case: Case) -> None:
        self.case, self.config = case, case.config
        self.state = initial_state(case.model.spec(case.config))
        self.twin = initial_state(case.model.spec(Config(**vars(case.config))))  # another rank
        self.model = NaiveParams(self.state.spec, case.config)
        self.passes, self.last = 0, None
        self.raised = False  # the last pass raised midway
        self.holding: list[tuple[int, ...]] = []  # open gathered_parameters contexts, nested
        self.events: list = []  # every event since the start, for the regression a failure prints

    def regression(self) -> str:
        """The events so far as a regression test to paste (`replay`)."""
        lines = ",\n".join(f"    {e!r}" for e in self.events)
        return ("the events, as a regression test:\n"
                "from fz3.config import Config\n"
                "from fz3.testing.models import Call, Case, External, Model\n"
                "from fz3.testing.param_events import *\n"
                "from fz3.testing.param_machine import replay\n"
                f"effects = replay({self.case!r}, [\n{lines}])")

    def event(self, ev, log: list[str]) -> tuple:
        """One event on the core, the naive model and the twin, then every per-event check:
        the naive model first (the oracle), then the core's own check_*, then purity and I6."""
        self.events.append(ev)
        before = self.state
        seen = snapshot(before)
        self.state, effects = apply_event(before, ev, self.config)
        log.append(f"  {ev} -> {list(effects)}")
        self.model.on_event(ev, effects)
        self.model.agree(self.state)
        covered("naive model", ev.kind)
        rules = self.model.rules
        rules.check(effects, self.state)  # liveness: what the trace's rules require, exactly
        if rules.want_prefetch:
            covered("naive model", "liveness: a prefetch, as the rules say")
        if rules.kept:
            covered("naive model", "liveness: a release keeps params, as the rules say")
        _inv.check_state(self.state)
        mode = before.trace.mode.name.lower()
        if type(ev) in (Fetch, Compute):
            _inv.check_fetched(self.state, ev.module)
            covered("I5", f"{ev.kind}, trace {mode}")
        if type(ev) in (Fetch, BackwardFetch):
            _inv.check_live_budget(self.state, effects, config=self.config)
            _inv.check_prefetch_reach(self.state, effects, config=self.config)
            prefetch = any(isinstance(e, AllGather) and e.prefetch for e in effects)
            covered("I1", f"{ev.kind}, trace {mode}, {'with' if prefetch else 'no'} prefetch")
        assert snapshot(before) == seen, f"{ev} changed the state it was given"  # purity
        again, again_effects = apply_event(before, ev, self.config)  # an old version replays
        assert again_effects == effects and snapshot(again) == snapshot(self.state), (
            f"{ev} replayed from the old state differently")
        covered("purity", ev.kind)
        self.twin, twin_effects = apply_event(self.twin, ev, self.config)
        assert twin_effects == effects, f"I6: twin emitted {twin_effects}, core {effects}"
        covered("I6", ev.kind)
        return effects

    @rule(again=st.integers(0, 3), which=st.sampled_from([0, 0, 1, 2]),
          backward=st.sampled_from(BACKWARDS), times=st.integers(1, 3), data=st.data())
    def one_pass(self, again: int, which: int, backward: str, times: int, data: st.DataObject) -> None:
        """`times` identical passes; `again` > 0 repeats the previous pass exactly (repeats are
        what lets the trace complete)."""
        if again and self.last is not None:
            which, backward, detail = self.last
        else:
            which %= len(self.case.programs)
            detail = None
            if backward == "partial":
                calls = count_calls(self.case.programs[which])
                detail = data.draw(st.frozensets(st.integers(0, calls - 1)), label="reached")
            elif backward == "raise":
                n = len(forward_events(self.case.programs[which]))
                detail = data.draw(st.integers(1, n - 1), label="raised after")
        log: list[str] = []
        try:
            for _ in range(times):
                self.run_pass(which, backward, detail, log)
        except BaseException:
            note(self.regression())
            raise
        finally:
            note("\n".join(log))

    @precondition(lambda self: self.finished)
    @rule()
    def optimizer_step(self) -> None:
        log = ["optimizer step"]
        try:
            self.event(EndOfStep(), log)
            _inv.check_quiescent(self.state)
        except BaseException:
            note(self.regression())
            raise
        finally:
            note("\n".join(log))
        self.finished = False

    @rule(data=st.data())
    def gathered_parameters(self, data: st.DataObject) -> None:
        """Enter (nested at most twice) or leave a `with fz3.gathered_parameters(...)`; passes
        and optimizer steps may run while one is open. Leaving with stale: values were edited."""
        if self.holding and (len(self.holding) == 2 or data.draw(st.booleans(), label="leave")):
            ev = UnholdParams(self.holding.pop(), data.draw(st.booleans(), label="stale"))
        else:
            n = len(self.state.spec.params)
            ev = HoldParams(tuple(sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=1,
                                                           max_size=3), label="hold"))))
            self.holding.append(ev.params)
        log: list[str] = []
        try:
            self.event(ev, log)
        except BaseException:
            note(self.regression())
            raise
        finally:
            note("\n".join(log))

    def run_pass(self, which: int, backward: str, detail: object = None,
                 log: list[str] | None = None) -> list[tuple[tuple, tuple]]:
        """One pass of program `which` (see pass_events); -> [(event, effects)]. Checks I2."""
        log = [] if log is None else log
        self.last = which, backward, detail
        events = pass_events(self.case.programs[which], backward, detail)
        # the shell's root pre-forward: a no_grad pass has its own trace; a pass after one that
        # raised (its stack left behind) is told so
        events[0] = Reset(backward != "none", self.raised)
        self.raised = backward == "raise"
        log.append(f"pass {self.passes}: program {which}, {backward} backward ({detail}), "
                   f"trace {self.state.trace.mode.name}")
        self.passes += 1
        out = []
        for ev in events:
            if type(ev) is Finish and backward == "complete":
                for m, ms in enumerate(self.state.modules):  # I2: complete backward, all 0 before
                    assert (ms.pre_backward, ms.grads_remaining) == (0, 0), (
                        f"I2: m{m} has counters {ms.pre_backward}/{ms.grads_remaining} "
                        "after a complete backward")
            out.append((ev, self.event(ev, log)))
        if type(events[-1]) is Finish:
            _inv.check_quiescent(self.state)  # I2
            covered("I2", f"{backward} backward")
        self.finished = type(events[-1]) is Finish
        return out


def run_passes(case: Case, schedule: list[tuple[int, str]]) -> tuple[ParamLifecycleMachine, list]:
    """Drive a machine outside Hypothesis, every check on: (program index, backward kind) per
    pass, or (_, "step") for an optimizer step. -> (machine, [[(event, effects)] per entry])."""
    machine = ParamLifecycleMachine()
    machine.start(case)
    out = []
    for which, kind in schedule:
        if kind == "step":
            out.append([(EndOfStep(), machine.event(EndOfStep(), []))])
        else:
            out.append(machine.run_pass(which, kind))
    return machine, out
