"""The module-call decisions as a Hypothesis state machine: the real fz3/core/events.py `update`
(fz3/core/calls.py's decisions), driven by a simulation of torch autograd (autograd_sim.py) that
sends it event records, against a naive model (calls_naive.py).

    initialize      draw a case (call_cases.py): a model with some params frozen, a
                    config (persistence on or off, so some modules are inert; 1 or 2
                    accumulation steps), a usual program and its variants, each call saving
                    params for backward or not
    one_pass        `times` passes of one program, each: a forward with grad and a complete or
                    partial backward, or none after it (abandoned); an eval forward (no grad);
                    or a forward that raises midway. After a backward (THEN): the engine's
                    step() (StepCalled, DeepSpeed's count or set_gradient_accumulation_boundary's
                    override; then Stepped if it closed the window, the grad norm finite or
                    not), or none (a later backward adds to the grads), or zero_grad() first
                    (GradsZeroed: refused exactly when a step() off the boundary took grads older
                    than the backwards since it)

After every event:
    the core's structural checks (check_state, check_grad_state);
    naive model   the hook effects (ZeroGrads aside) are those calls_naive.py predicts: which
                  calls get autograd nodes (inertness, reads none), GradDue, the pass and
                  backward markers; every module's externals are the ones it predicts
    reports       a param reported to the grad lifecycle (its `reported` moves to this
                  backward) got a grad in this backward or belongs to a leaf run with grad, and
                  has no contribution still to come ("reported before its last contribution");
                  ZeroGrads names those of a leaf's trainable params that got no grad (the
                  others are the ones torch shows with a grad: `with_grad`), reported in the
                  same event, as stand-ins: the step that follows leaves a param that no
                  backward of its window gave a grad without one (StepOptimizer)
    purity        the event left the state it was given unchanged, and replays from it the same
and the simulation's own (what torch would fail at): I5 in forward and in backward, AccumulateGrad
finding a shape, end of backward queued exactly once per backward. After BackwardEnded: every
trainable param that got a grad in it, and every trainable param of a leaf run with grad in the
pass, was reported; I2 (check_quiescent: nothing gathered but persistent / external params,
every counter 0); the calls state idle; no grad placeholder left.

A failure prints, beside the log of its passes, its events from the start as a regression test
to paste: `replay(case, [Enter(...), Leave(...), ...])` runs them through `update` with the
core's checks and the naive model's, and returns each event's effects to assert on.

Reuse:  from fz3.testing.calls_machine import CallsMachine
        TestCalls = CallsMachine.TestCase
"""
from __future__ import annotations

import sys
from dataclasses import replace

import fz3.testing.extra  # noqa: F401 - Hypothesis, or an ImportError naming the test extra
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from fz3.core import events as core_events
from fz3.core.param import invariants as inv
from fz3.core.calls import Lifecycle, initial_calls
from fz3.core.grad.epilogue import at_boundary
from fz3.core.events import BackwardEnded, Enter, GradReady, GradsZeroed, Leave, Read, StepCalled, Stepped
from fz3.core.grad.grads import GradError, GradState, init_grad_state
from fz3.core.hook_effects import HOOK_EFFECTS, GradDue, SkipStep, StepOptimizer, ZeroGrads
from fz3.core.grad.invariants import check_grad_state
from fz3.core.param.state import initial_state
from fz3.testing.autograd_sim import AutogradSim
from fz3.testing.call_cases import KNOWN_GAPS, call_cases, forward_ticks
from fz3.testing.calls_naive import NaiveCalls
from fz3.testing.coverage import covered
from fz3.testing.models import Case, count_calls
from fz3.testing.param_machine import snapshot as params_snapshot

KINDS = ("complete", "complete", "complete", "partial", "eval", "abandon", "raise")
# after a backward: the engine's step() as a loop calls it (its grad norm finite, not, or left to
# the device: [Note: the verdict on the device]; DeepSpeed's count of step() calls, or
# set_gradient_accumulation_boundary's override), none, or zero_grad()
THEN = ("step", "step", "step", "step, norm on the device", "step, norm not finite", "step, boundary",
        "step, no boundary", "no step", "zero_grad, step")


def naive_threshold(config) -> int:
    """The naive model's persistence: every param at ZeRO stages 0-2 (their params are whole),
    said here apart from fz3/core/stage.py so that a bug there is not copied."""
    return sys.maxsize if config.stage < 3 else config.param_persistence_threshold


def grads_snapshot(g: GradState) -> tuple:
    return (list(g.params), g.buckets, g.next_bucket, g.backward, g.micro_step, g.window, g.micro_backwards,
            g.committed, g.averaged)


def snapshot(s: Lifecycle) -> tuple:
    """Everything the three lifecycles say, as plain values."""
    return params_snapshot(s.params), grads_snapshot(s.grads), s.calls


class CallsMachine(RuleBasedStateMachine):
    """Drives fz3.core.calls through passes of drawn programs; see the module docstring."""

    naive = True  # hold the core against calls_naive.py (a teeth test may switch it off to show
    # that the simulation's own checks catch a bug too)
    avoid = KNOWN_GAPS  # situations the simulation steers clear of (a gap's regression test: none)
    quiet = False  # every call's events, as under fz3.check; QuietCallsMachine: the engine's

    def __init__(self) -> None:
        super().__init__()
        self.case: Case | None = None

    @initialize(case=call_cases())
    def setup(self, case: Case) -> None:
        note(f"case: {case}")
        self.start(case)
        covered("examples", "module calls")

    def start(self, case: Case) -> None:
        """With the class's `quiet`, the events as the engine sends them (a quiet module's call
        inside another takes none: [Note: inert modules]); else every call's, as fz3.check."""
        self.case, self.config = case, case.config
        spec = case.model.spec(case.config)
        trainable = self.trainable = case.model.trainable or (True,) * len(case.model.params)
        self.state = Lifecycle(initial_state(spec), init_grad_state(spec),
                               initial_calls(spec, trainable, case.config))
        self.sim = AutogradSim(spec, trainable, self, avoid=self.avoid, quiet=self.quiet)
        self.model = NaiveCalls(spec, trainable, naive_threshold(case.config))
        self.passes, self.last, self.log, self.then = 0, None, [], "step"
        self.events: list = []  # every event since the start, for the regression a failure prints
        self.reported: set[int] = set()
        homes: dict[int, list[bool]] = {}
        for ms in spec.modules:
            for p in ms.params:
                homes.setdefault(p, []).append(ms.is_leaf)
        # a leaf's own params (in no other module) are reported with the leaf, zeros if need be
        self.leaf_own = {p for p, h in homes.items() if h == [True]}

    # ---- one event -------------------------------------------------------------------------------
    def fire(self, event) -> tuple:
        """Run one event record on the core (`update`, looked up at call time: teeth tests
        monkeypatch fz3.core.calls) and check it; -> its effects."""
        before = self.state
        seen = snapshot(before)
        self.events.append(event)
        self.state, effects = core_events.update(before, event, config=self.config)
        self.log.append(f"  {_shown(event)} -> {list(effects)}")
        inv.check_state(self.state.params)
        check_grad_state(self.state.grads, config=self.config)
        self.agree(event, effects)
        self.check_reports(event, before, effects)
        kind = type(event).__name__
        assert snapshot(before) == seen, f"{kind} changed the state it was given"
        again, again_effects = core_events.update(before, event, config=self.config)
        assert again_effects == effects and snapshot(again) == snapshot(self.state), (
            f"{kind} replayed from the old state differently")
        covered("purity", kind)
        self.cover(event, before, effects)
        if type(event) is BackwardEnded:
            self.after_backward()
        return effects

    def regression(self) -> str:
        """The events so far as a regression test to paste (see the module docstring)."""
        lines = ",\n".join(f"    {e!r}" for e in self.events)
        return ("the events, as a regression test:\n"
                "from fz3.config import Config\n"
                "from fz3.config.offload import Aio, OffloadOptimizer, OffloadParam\n"
                "from fz3.core.events import *\n"
                "from fz3.core.pvec import Log\n"
                "from fz3.testing.calls_machine import replay\n"
                "from fz3.testing.models import Call, Case, External, Model\n"
                f"effects = replay({self.case!r}, [\n{lines}])")

    def saved(self, params: frozenset[int]) -> None:
        self.model.saved(params)

    def agree(self, event, effects: tuple) -> None:
        """The naive model follows every event; it is held against the core if `naive`."""
        if self.naive:
            agree_with_naive(self.model, self.state, event, effects)
        else:
            self.model.expect(event)

    def leaf_grads(self) -> set[int]:
        """Trainable params of the leaves run with grad in this pass: reported even without a
        grad (zeros stand in), so every rank reduces the same set."""
        spec = self.state.params.spec
        return {p for m in self.model.grad_leaves for p in spec.modules[m].params
                if self.trainable[p] and p in self.leaf_own}

    def check_reports(self, event, before: Lifecycle, effects: tuple) -> None:
        """The params this event reported to the grad lifecycle had a grad to report, and all
        of it: no contribution still to come in this backward."""
        kind = type(event).__name__
        b, old, new = before.grads.backward, before.grads.params, self.state.grads.params
        fresh = [p for p in range(len(new)) if new[p].reported == b and old[p].reported != b]
        for p in fresh:
            assert p in self.sim.contributed or p in self.leaf_grads(), (
                f"p{p} reported at {kind} without a grad in this backward")
            left = self.sim.remaining[p]
            assert left == 0, (
                f"p{p} reported at {kind} before its last contribution ({left} to come)")
            self.reported.add(p)
            leaf = p in self.leaf_own
            covered("reported once", f"{'leaf' if leaf else 'hooked'} param, at {kind}")
        spec, t = self.state.params.spec, self.trainable
        for e in effects:
            if isinstance(e, ZeroGrads):
                leaves = [m for m in self.model.grad_leaves
                          if e.params == tuple(p for p in spec.modules[m].params
                                               if t[p] and p in self.leaf_own and p not in self.sim.contributed)]
                assert leaves and set(e.params) <= self.reported, (
                    f"{e} at {kind}: not the trainable params without a grad of one leaf, or not "
                    "reported with it")

    def after_backward(self) -> None:
        self.model.got |= self.sim.contributed
        missing = (self.sim.contributed | self.leaf_grads()) - self.reported
        assert not missing, (
            f"params {sorted(missing)} got grads in this backward but were never reported")
        inv.check_quiescent(self.state.params)  # I2, counters included
        c = self.state.calls
        assert not (c.waiting or c.leaves or c.backward or c.stack), f"calls state not idle: {c}"
        covered("I2", "end of backward (module calls)")

    def cover(self, event, before: Lifecycle, effects: tuple) -> None:
        """Count the decisions this event took."""
        kind = type(event).__name__
        now, old, modules = self.state.params, before.params, range(len(self.state.params.spec.modules))
        if type(event) is Enter and event.grad and self.state.calls.tables.inert[
                self.state.calls.stack[-1].module]:
            covered("call decisions", "inert call: no autograd nodes")
        if any(isinstance(e, GradDue) for e in effects):
            covered("call decisions", "call reading no param: over at its leave")
        if type(event) is GradReady and any(now.grads_remaining(m) < old.grads_remaining(m)
                                        for m in modules):
            covered("call decisions", "waiting call released by its grads")
        b, new = before.grads.backward, self.state.grads.params
        if any(new[p].reported == b and before.grads.params[p].reported != b for p in self.leaf_own):
            covered("call decisions", f"leaf reduced at {kind}")
        if any(isinstance(e, ZeroGrads) for e in effects):
            covered("call decisions", "leaf expert without a grad: zeros stand in")
        for e in effects:
            if isinstance(e, StepOptimizer) and e.no_grad:
                leaf = any(p in self.leaf_own for p in e.no_grad)
                covered("call decisions", "step leaves a param without a grad" + (" (a leaf's)" if leaf else ""))
            if isinstance(e, SkipStep):
                covered("call decisions", "step skipped: grad norm not finite")
            if isinstance(e, StepOptimizer) and e.guarded:
                covered("call decisions", "step guarded: its verdict left to the device")
        if type(event) in (Leave, Read) and any(now.externals(m) != old.externals(m)
                                                for m in modules):
            covered("call decisions", "returned param external on the caller" if type(event) is Leave
                    else "borrowed param external on the reader")

    # ---- rules -----------------------------------------------------------------------------------
    @rule(again=st.integers(0, 3), which=st.sampled_from([0, 0, 1, 2]),
          kind=st.sampled_from(KINDS), times=st.integers(1, 3), data=st.data(), then=st.sampled_from(THEN))
    def one_pass(self, again: int, which: int, kind: str, times: int, data: st.DataObject, then: str) -> None:
        """`times` identical passes; `again` > 0 repeats the previous pass exactly (repeats let
        the trace complete, so prefetch and reuse keeping join in). `then`: what follows each
        backward (THEN): the engine's step() as a training loop calls it, or none (the grads
        wait for a later backward's step), or a zero_grad() first."""
        self.then = then
        if again and self.last is not None:
            which, kind, detail = self.last
        else:
            which %= len(self.case.programs)
            program, detail = self.case.programs[which], None
            if kind == "partial":
                detail = data.draw(st.frozensets(st.integers(0, count_calls(program) - 1)),
                                   label="reached")
            elif kind == "raise":
                detail = data.draw(st.integers(2, forward_ticks(program)), label="raise at tick")
        self.last = which, kind, detail
        self.passes_of(which, kind, detail, times)

    def passes_of(self, which: int, kind: str, detail: object, times: int) -> None:
        """`times` passes of program `which`, logged; a failure notes the regression to paste."""
        self.logged([], lambda: [self.run_pass(which, kind, detail) for _ in range(times)])

    def logged(self, log: list[str], run) -> None:
        """`run()` with `log` as the step log noted after it, and on a failure the events so far
        as a regression test."""
        self.log = log
        try:
            run()
        except BaseException:
            note(self.regression())
            raise
        finally:
            note("\n".join(self.log))

    def step_now(self, finite: bool | None = True, boundary: bool | None = None) -> None:
        """The engine's step(): StepCalled, then Stepped once the window closed (`finite` None:
        the verdict left to the device)."""
        said = {True: "finite", False: "not finite", None: "left to the device"}[finite]
        self.log.append(f"step() (override {boundary}; grad norm {said})")
        self.sim.fire(StepCalled(boundary=boundary))
        if at_boundary(self.state.grads, config=self.config):
            self.sim.fire(Stepped(finite=finite))
            covered("call decisions", "window closed at step()" + (f" (override {boundary})" if boundary is not None
                                                                   else ""))

    def zero_grad(self) -> None:
        """The user's zero_grad(): refused exactly when a step() off the boundary summed older
        grads with those of the backwards since it ([Note: zero_grad in a window])."""
        self.log.append("zero_grad()")
        g = self.state.grads
        refused = g.committed and g.micro_backwards > 0
        try:
            self.sim.fire(GradsZeroed())
        except GradError as e:
            assert refused and "cannot drop them alone" in str(e), f"zero_grad() refused: {e}"
            self.events.pop()
            covered("misuse refused", "zero_grad() after a step() inside the window")
            return
        assert not refused, "zero_grad() dropped grads a step() off the boundary had summed with older ones"
        if g.micro_backwards:
            self.model.got = set()  # the naive model's grads of the window: dropped with them
            covered("call decisions", "zero_grad() drops the grads since the last step()")

    def run_pass(self, which: int, kind: str, detail: object = None) -> None:
        backward = kind in ("complete", "partial")
        self.log.append(f"pass {self.passes}: program {which}, {kind} ({detail})")
        self.passes += 1
        self.sim.forward(self.case.programs[which], grad=kind != "eval",
                         stop=detail if kind == "raise" else None)
        if backward:
            self.reported = set()
            self.sim.backward(detail if kind == "partial" else None)
            if self.then == "no step":
                covered("call decisions", "a backward before another, one step() for both")
                return
            if self.then == "zero_grad, step":
                self.zero_grad()
            self.step_now(finite={"step, norm not finite": False, "step, norm on the device": None}.get(self.then, True),
                          boundary={"step, boundary": True, "step, no boundary": False}.get(self.then))


def _shown(event) -> str:
    """An event for the log: the saved-param log (a Leave's) left out, it only grows."""
    return repr(event._replace(saved=...)) if type(event) is Leave else repr(event)


def agree_with_naive(model: NaiveCalls, state: Lifecycle, event, effects: tuple) -> None:
    """The hook effects (ZeroGrads aside) are the naive model's, and so is every module's set
    of externals after the event."""
    want = model.expect(event)
    got = [e for e in effects if isinstance(e, HOOK_EFFECTS) and not isinstance(e, ZeroGrads)]
    assert got == want, f"naive model: {_shown(event)} emitted hook effects {got}, expected {want}"
    for m in range(len(state.params.spec.modules)):
        ext = state.params.externals(m)
        assert set(ext) == model.externals[m], (
            f"naive model: after {_shown(event)} m{m} has externals {sorted(ext)}, "
            f"expected {sorted(model.externals[m])}")
    covered("naive model", type(event).__name__)


def replay(case: Case, events: list) -> list[tuple]:
    """Run `events` (records of fz3/core/events.py) from the start of `case` through `update`,
    each checked as the machine checks it without the simulation: the core's structural
    invariants, purity, and the naive model's hook effects and externals. -> each event's
    effects. What a failing machine prints calls this (CallsMachine.regression)."""
    spec = case.model.spec(case.config)
    trainable = case.model.trainable or (True,) * len(case.model.params)
    state = Lifecycle(initial_state(spec), init_grad_state(spec), initial_calls(spec, trainable, case.config))
    model = NaiveCalls(spec, trainable, naive_threshold(case.config))
    out = []
    for event in events:
        seen = snapshot(state)
        new, effects = core_events.update(state, event, config=case.config)
        inv.check_state(new.params)
        check_grad_state(new.grads, config=case.config)
        assert snapshot(state) == seen, f"{type(event).__name__} changed the state it was given"
        agree_with_naive(model, new, event, effects)
        state = new
        out.append(effects)
    return out


class StagesCallsMachine(CallsMachine):
    """The machine at ZeRO stages 0-2 (fz3/core/stage.py): every param persistent, and at stages
    0 and 1 every trainable param hooked, its grads waiting in param.grad for the boundary.
    CallsMachine itself draws stage-3 cases, where params are freed."""

    @initialize(case=call_cases(), stage=st.sampled_from([0, 1, 2]))
    def setup(self, case: Case, stage: int) -> None:
        case = replace(case, config=case.config.replace(stage=stage))
        note(f"case: {case}")
        self.start(case)
        covered("examples", "module calls")


class QuietCallsMachine(CallsMachine):
    """The events as the engine sends them: an inert module's call inside another call takes
    none ([Note: inert modules], fz3/core/calls.py). Its params must be live all the same (the
    simulation's I5), and the core's decisions for the calls it does hear of are the naive
    model's."""

    quiet = True

    @initialize(case=call_cases(), every_param_persistent=st.booleans())
    def setup(self, case: Case, every_param_persistent: bool) -> None:
        """Half the cases with every param persistent: only there are calls quiet."""
        if every_param_persistent:
            case = Case(case.model, case.config.replace(param_persistence_threshold=10**9), case.programs)
        CallsMachine.setup(self, case)
