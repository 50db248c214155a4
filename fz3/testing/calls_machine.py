"""The module-call decisions as a Hypothesis state machine: the real fz3/core/calls.py, driven by
a simulation of torch autograd (autograd_sim.py), against a naive model (calls_naive.py).

    initialize      draw a case (call_cases.py): a model with some params frozen, a
                    config (persistence on or off, so some modules are inert; 1 or 2
                    accumulation steps), a usual program and its variants, each call saving
                    params for backward or not
    one_pass        `times` passes of one program, each: a forward with grad and a complete or
                    partial backward, or none after it (abandoned); an eval forward (no grad);
                    or a forward that raises midway. A backward at the accumulation boundary
                    is preceded by the optimizer step
    optimizer_step  `stepped`, at the accumulation boundary, the grad norm finite or not

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
finding a shape, end of backward queued exactly once per backward. After end_of_backward: every
trainable param that got a grad in it, and every trainable param of a leaf run with grad in the
pass, was reported; I2 (check_quiescent: nothing gathered but persistent / external params,
every counter 0); the calls state idle; no grad placeholder left.

Reuse:  from fz3.testing.calls_machine import CallsMachine
        TestCalls = CallsMachine.TestCase
"""
from __future__ import annotations

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from fz3.core import calls
from fz3.core import invariants as inv
from fz3.core.calls import Lifecycle, initial_calls
from fz3.core.epilogue import at_boundary
from fz3.core.grads import GradState, init_grad_state
from fz3.core.hook_effects import HOOK_EFFECTS, GradDue, SkipStep, StepOptimizer, ZeroGrads
from fz3.core.invariants_grad import check_grad_state
from fz3.core.state import EXTERNALS, GRADS_REMAINING, initial_state
from fz3.testing.autograd_sim import AutogradSim
from fz3.testing.call_cases import KNOWN_GAPS, call_cases, forward_ticks
from fz3.testing.calls_naive import NaiveCalls
from fz3.testing.coverage import covered
from fz3.testing.models import Case, count_calls
from fz3.testing.param_machine import snapshot as params_snapshot

KINDS = ("complete", "complete", "complete", "partial", "eval", "abandon", "raise")


def grads_snapshot(g: GradState) -> tuple:
    return (list(g.params), g.buckets, g.next_bucket, g.backward, g.micro_step, g.window)


def snapshot(s: Lifecycle) -> tuple:
    """Everything the three lifecycles say, as plain values."""
    return params_snapshot(s.params), grads_snapshot(s.grads), s.calls


class CallsMachine(RuleBasedStateMachine):
    """Drives fz3.core.calls through passes of drawn programs; see the module docstring."""

    naive = True  # hold the core against calls_naive.py (a teeth test may switch it off to show
    # that the simulation's own checks catch a bug too)
    avoid = KNOWN_GAPS  # situations the simulation steers clear of (a gap's regression test: none)

    def __init__(self) -> None:
        super().__init__()
        self.case: Case | None = None

    @initialize(case=call_cases())
    def setup(self, case: Case) -> None:
        note(f"case: {case}")
        self.start(case)
        covered("examples", "module calls")

    def start(self, case: Case) -> None:
        self.case, self.config = case, case.config
        spec = case.model.spec(case.config)
        trainable = self.trainable = case.model.trainable or (True,) * len(case.model.params)
        self.state = Lifecycle(initial_state(spec), init_grad_state(spec),
                               initial_calls(spec, trainable))
        self.sim = AutogradSim(spec, trainable, self, avoid=self.avoid)
        self.model = NaiveCalls(spec, trainable, case.config.param_persistence_threshold)
        self.passes, self.last, self.log = 0, None, []
        self.reported: set[int] = set()
        homes: dict[int, list[bool]] = {}
        for ms in spec.modules:
            for p in ms.params:
                homes.setdefault(p, []).append(ms.is_leaf)
        # a leaf's own params (in no other module) are reported with the leaf, zeros if need be
        self.leaf_own = {p for p, h in homes.items() if h == [True]}

    # ---- one event -------------------------------------------------------------------------------
    def fire(self, kind: str, *args: object, **kwargs: object) -> tuple:
        """Run one event on the core (looked up at call time: teeth tests monkeypatch it) and
        check it; -> its effects."""
        before = self.state
        seen = snapshot(before)
        transition = getattr(calls, kind)
        self.state, effects = transition(before, *args, config=self.config, **kwargs)
        shown = {k: v for k, v in kwargs.items() if k != "saved"}
        self.log.append(f"  {kind}{args} {shown} -> {list(effects)}")
        inv.check_state(self.state.params)
        check_grad_state(self.state.grads, config=self.config)
        self.agree(kind, args, kwargs, effects)
        self.check_reports(kind, before, effects)
        assert snapshot(before) == seen, f"{kind} changed the state it was given"
        again, again_effects = transition(before, *args, config=self.config, **kwargs)
        assert again_effects == effects and snapshot(again) == snapshot(self.state), (
            f"{kind} replayed from the old state differently")
        covered("purity", f"calls.{kind}")
        self.cover(kind, kwargs, before, effects)
        if kind == "end_of_backward":
            self.after_backward()
        return effects

    def saved(self, params: frozenset[int]) -> None:
        self.model.saved(params)

    def agree(self, kind: str, args: tuple, kwargs: dict, effects: tuple) -> None:
        """The naive model follows every event; it is held against the core if `naive`."""
        want = self.model.expect(kind, args, kwargs)
        if not self.naive:
            return
        got = [e for e in effects if isinstance(e, HOOK_EFFECTS) and not isinstance(e, ZeroGrads)]
        assert got == want, f"naive model: {kind}{args} emitted hook effects {got}, expected {want}"
        for m, row in enumerate(self.state.params.module_rows):
            assert set(row[EXTERNALS]) == self.model.externals[m], (
                f"naive model: after {kind}{args} m{m} has externals {sorted(row[EXTERNALS])}, "
                f"expected {sorted(self.model.externals[m])}")
        covered("naive model", f"calls.{kind}")

    def leaf_grads(self) -> set[int]:
        """Trainable params of the leaves run with grad in this pass: reported even without a
        grad (zeros stand in), so every rank reduces the same set."""
        spec = self.state.params.spec
        return {p for m in self.model.grad_leaves for p in spec.modules[m].params
                if self.trainable[p] and p in self.leaf_own}

    def check_reports(self, kind: str, before: Lifecycle, effects: tuple) -> None:
        """The params this event reported to the grad lifecycle had a grad to report, and all
        of it: no contribution still to come in this backward."""
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

    def cover(self, kind: str, kwargs: dict, before: Lifecycle, effects: tuple) -> None:
        """Count the decisions this event took."""
        rows, old = self.state.params.module_rows, before.params.module_rows
        if kind == "enter" and kwargs["grad"] and self.state.calls.tables.inert[
                self.state.calls.stack[-1].module]:
            covered("call decisions", "inert call: no autograd nodes")
        if any(isinstance(e, GradDue) for e in effects):
            covered("call decisions", "call reading no param: over at its leave")
        if kind == "grad_ready" and any(rows[m][GRADS_REMAINING] < old[m][GRADS_REMAINING]
                                        for m in range(len(rows))):
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
        if kind in ("leave", "read") and any(rows[m][EXTERNALS] != old[m][EXTERNALS]
                                             for m in range(len(rows))):
            covered("call decisions", "returned param external on the caller" if kind == "leave"
                    else "borrowed param external on the reader")

    # ---- rules -----------------------------------------------------------------------------------
    @rule(again=st.integers(0, 3), which=st.sampled_from([0, 0, 1, 2]),
          kind=st.sampled_from(KINDS), times=st.integers(1, 3), data=st.data())
    def one_pass(self, again: int, which: int, kind: str, times: int, data: st.DataObject) -> None:
        """`times` identical passes; `again` > 0 repeats the previous pass exactly (repeats let
        the trace complete, so prefetch and reuse keeping join in)."""
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
        self.log = []
        try:
            for _ in range(times):
                self.run_pass(which, kind, detail)
        finally:
            note("\n".join(self.log))

    @precondition(lambda self: at_boundary(self.state.grads, config=self.config))
    @rule(finite=st.sampled_from([True, True, False]))
    def optimizer_step(self, finite: bool) -> None:
        self.log = [f"optimizer step (grad norm {'finite' if finite else 'not finite'})"]
        try:
            self.sim.fire("stepped", finite=finite)
        finally:
            note("\n".join(self.log))

    def run_pass(self, which: int, kind: str, detail: object = None) -> None:
        backward = kind in ("complete", "partial")
        if backward and at_boundary(self.state.grads, config=self.config):
            self.log.append("optimizer step")
            self.sim.fire("stepped")
        self.log.append(f"pass {self.passes}: program {which}, {kind} ({detail})")
        self.passes += 1
        self.sim.forward(self.case.programs[which], grad=kind != "eval",
                         stop=detail if kind == "raise" else None)
        if backward:
            self.reported = set()
            self.sim.backward(detail if kind == "partial" else None)
