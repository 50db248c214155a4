"""Teeth: the calls machine must catch deliberately broken module-call decisions.

Each test monkeypatches one decision of fz3.core.calls at its use site (the machine looks each
event up on fz3.core.calls when it runs it; the events find their helpers in the module's
globals) and asserts that the machine fails, deterministically (derandomized, no database,
generate phase only, within the 100 examples allowed), and that the check meant for the bug is
the one that fires. Where the naive model (fz3/testing/calls_naive.py) sees the bug first,
because it predicts the hook effects, the test runs twice: the naive model must catch it, and
without it the simulation must too, where torch would fail (fz3/testing/autograd_sim.py).

    CI=1 pytest property_tests/test_calls_teeth.py
"""
from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

import fz3.core.calls as calls
from fz3.core.grad.grads import GradError
from fz3.core.calls import Lifecycle
from fz3.core.hook_effects import QueueEndOfBackward
from fz3.core.pvec import Log
from fz3.core.spec import ModelSpec
from fz3.testing.calls_machine import CallsMachine

HUNT = settings(max_examples=200, stateful_step_count=12, derandomize=True, database=None,
                deadline=None, phases=(Phase.generate,), report_multiple_bugs=False,
                suppress_health_check=list(HealthCheck))


class WithoutNaive(CallsMachine):
    """The machine with only the simulation's checks and the invariants."""

    naive = False


def assert_caught(pattern: str, machine: type = CallsMachine,
                  errors: tuple = (AssertionError,)) -> None:
    """`machine` fails with one of `errors` whose message matches `pattern`."""
    with pytest.raises(errors) as info:
        run_state_machine_as_test(machine, settings=HUNT)
    assert re.search(pattern, str(info.value)), f"caught by another check: {info.value}"


BY_NAIVE_OR_SIM = pytest.mark.parametrize("naive", [True, False], ids=["naive model", "simulation"])


def caught_by(naive: bool, by_naive: str, by_simulation: str) -> None:
    """Caught by the naive model (`by_naive`), or, without it, by the simulation's own checks."""
    if naive:
        assert_caught(by_naive)
    else:
        assert_caught(by_simulation, WithoutNaive)


@BY_NAIVE_OR_SIM
def test_inertness_too_wide_is_caught(monkeypatch, naive):
    """(a) every non-leaf module but the root is inert, whatever its params: a module whose
    params are freed after its forward gets no PreBackward node, so its backward computes
    without them."""
    real = calls.call_tables

    def all_persistent(spec, trainable, **kw):
        persistent = tuple(p._replace(persistent=True) for p in spec.params)
        return real(ModelSpec(persistent, spec.modules, spec.world_size), trainable, **kw)

    monkeypatch.setattr(calls, "call_tables", all_persistent)
    # the first node it misses: a PostBackward, or a PreBackward where its calls are released by
    # their grads ([Note: released by its grads])
    caught_by(naive, r"naive model: (Enter.*emitted hook effects \[\], expected \[WrapInputs|"
                     r"Leave.*emitted hook effects \[\], expected \[WrapOutputs)",
              r"I5 in backward: .* NOT_AVAILABLE")


def test_waiting_call_released_at_its_first_grad_is_caught(monkeypatch):
    """(b) a call without grad inputs is released when the first of its params' grads comes in,
    not the last: its backward computes the next grad with its params freed."""
    real = calls._grad_in

    def eager(c, params, m, p, config):
        waiting = tuple(w._replace(due=frozenset({p})) if w.module == m and p in w.due else w
                        for w in c.waiting)
        return real(c._replace(waiting=waiting), params, m, p, config)

    monkeypatch.setattr(calls, "_grad_in", eager)
    # its backward computes with a freed param, or a later grad finds it freed without a placeholder
    assert_caught(r"I5 in backward: .* NOT_AVAILABLE|AccumulateGrad of .* NOT_AVAILABLE with no GradDue placeholder")


@BY_NAIVE_OR_SIM
def test_reads_none_ignoring_the_saved_log_is_caught(monkeypatch, naive):
    """(c) every watched call without grad inputs is taken to read none of its params in
    backward (the saved-param log is not read): one that saved them is freed, with no
    PreBackward node to gather them again."""
    real = calls.leave

    def blind(st, ev, *, config):
        return real(st, ev._replace(saved=None if ev.saved is None else Log()), config=config)

    monkeypatch.setattr(calls, "leave", blind)
    caught_by(naive, r"naive model: Leave.*expected \[WrapOutputs",
              r"I5 in backward: .* NOT_AVAILABLE")


@BY_NAIVE_OR_SIM
def test_released_by_grads_with_a_frozen_param_is_caught(monkeypatch, naive):
    """(c2) every call with grad inputs of a module with some trainable own param is released by
    its grads ([Note: released by its grads]), frozen own params or not: no grad says when the
    backward is done with a frozen one, so its input grads are computed with it freed."""
    real = calls.call_tables

    def wide(spec, trainable, **kw):
        t = real(spec, trainable, **kw)
        return t._replace(by_grads=tuple(bool(g) for g in t.grad_params))

    monkeypatch.setattr(calls, "call_tables", wide)
    caught_by(naive, r"naive model: Enter.*expected \[.*WrapInputs",
              r"I5 in backward: .* NOT_AVAILABLE")


def test_leaf_reduced_at_its_first_post_backward_is_caught(monkeypatch):
    """(d) a leaf is reduced at the post_backward of any of its calls, not its last: the grads
    of its earlier calls come after the report."""
    real = calls.post_backward

    def eager(st, ev, *, config):
        if ev.module not in st.calls.leaves:
            return real(st, ev, config=config)
        c, queued = calls._in_backward(st.calls)
        c, grads, reduced = calls._reduce_leaf(c, st.grads, ev.module, config, ev.with_grad)
        st, effects = real(Lifecycle(st.params, grads, c), ev, config=config)
        return st, queued + reduced + effects

    monkeypatch.setattr(calls, "post_backward", eager)
    assert_caught("reported at PostBackwardRan before its last contribution")


def test_leaf_not_reduced_at_end_of_backward_is_caught(monkeypatch):
    """(e) end_of_backward forgets the leaves no post_backward reduced (a leaf whose inputs need
    no grad): their grads are never reported."""
    real = calls.end_of_backward

    def forgetful(st, ev, *, config):
        return real(st._replace(calls=st.calls._replace(leaves=frozenset())), ev, config=config)

    monkeypatch.setattr(calls, "end_of_backward", forgetful)
    # the machine's check, or the core's own (calls._check_no_late_leaf_grad) before it
    assert_caught("got grads in this backward but were never reported|got its grad after the leaf was reduced",
                  errors=(AssertionError, GradError))


@BY_NAIVE_OR_SIM
def test_returned_params_not_registered_is_caught(monkeypatch, naive):
    """(f) a param a call returns is not registered on its caller: the callee's release frees
    it, and the caller computes with it."""
    real = calls.leave

    def dropped(st, ev, *, config):
        return real(st, ev._replace(returned=()), config=config)

    monkeypatch.setattr(calls, "leave", dropped)
    caught_by(naive, r"naive model: after Leave.* has externals",
              r"I5 in forward: .* NOT_AVAILABLE")


@BY_NAIVE_OR_SIM
def test_borrowed_params_not_registered_is_caught(monkeypatch, naive):
    """(g) a param read off another module's _parameters is not registered on the reader: it
    computes with a param nobody gathered."""
    monkeypatch.setattr(calls, "read", lambda st, ev, *, config: (st, ()))
    caught_by(naive, r"naive model: after Read.* has externals",
              r"I5 in forward: .* NOT_AVAILABLE")


@pytest.mark.parametrize("queue", ["every event", "never"])
@BY_NAIVE_OR_SIM
def test_end_of_backward_not_queued_once_is_caught(monkeypatch, queue, naive):
    """(h) the end of backward is queued at every backward event (autograd would run the
    epilogue several times), or never (it would not run)."""
    queued = (QueueEndOfBackward(),) if queue == "every event" else ()
    monkeypatch.setattr(calls, "_in_backward", lambda c: (c._replace(backward=True), queued))
    caught_by(naive, r"naive model: (PreBackwardRan|PostBackwardRan|GradReady)",
              r"end of backward queued (0|[2-9]\d*) times in one backward")


@pytest.mark.parametrize("wrong", ["every trainable param hooked", "no param hooked"])
def test_a_wrong_hook_set_is_caught(monkeypatch, wrong):
    """(i) which params get a post-accumulate-grad hook (the core's CallTables.hooked, which the
    shell installs): hooking a leaf's own params reports them twice (by the hook and with the
    leaf); hooking none leaves every other param's grad unreported."""
    real = calls.call_tables

    def tables(spec, trainable, **kw):
        t = real(spec, trainable, **kw)
        return t._replace(hooked=tuple(bool(x) and wrong.startswith("every") for x in trainable))

    monkeypatch.setattr(calls, "call_tables", tables)
    assert_caught(r"reported twice|never reported|without a grad|not one leaf.s trainable params",
                  errors=(AssertionError, GradError))


def test_a_step_that_gives_every_param_a_grad_is_caught(monkeypatch):
    """(j) stepped names no param without a grad: zeros would move them (AdamW's decay)."""
    monkeypatch.setattr(calls, "no_grad_params", lambda st, leaf_grads=None: ())
    assert_caught(r"naive model: Stepped.*expected \[StepOptimizer\(no_grad=\(\d")


def test_a_step_taken_on_a_grad_norm_not_finite_is_caught(monkeypatch):
    """(k) stepped ignores the norm: a NaN would reach the weights."""
    real = calls.stepped
    monkeypatch.setattr(calls, "stepped", lambda st, ev, *, config: real(st, ev._replace(finite=True), config=config))
    assert_caught(r"naive model: Stepped.*expected \[SkipStep")


def test_zeros_standing_in_for_a_leafs_grad_counted_as_a_grad_are_caught(monkeypatch):
    """(l) a leaf's stand-in zeros mark the param as having had a grad: the step moves it."""
    real = calls.bucket_add
    monkeypatch.setattr(calls, "bucket_add", lambda *a, stand_in=False, **k: real(*a, **k))
    assert_caught(r"naive model: Stepped.*expected \[StepOptimizer")


def test_quiet_calls_where_params_are_freed_are_caught(monkeypatch):
    """(q) every inert module quiet, params freed or not: a call inside another that reads a
    param off the _parameters of the call around it leaves that read to the owner's own call,
    which frees the param at its grads while the inert call's backward still needs it (I5).
    A small such pass: the root owns w, frozen, and v, and waits for v's grad (its input needs
    none), `box` (no params: inert) reads w. (The quiet machine first found it with w
    trainable, under a simulation that let a call read a param after its last grad, which torch
    does not: [Note: no read after the last grad], fz3/testing/autograd_sim.py.)"""
    from fz3.testing.autograd_sim import SimError
    from fz3.testing.calls_machine import QuietCallsMachine
    from fz3.testing.models import Call, Case, External, Model
    from fz3.config.config import Config
    case = Case(Model(1, (("w", 4), ("v", 4)), (("", (0, 1), False), ("box", (), False)), (1,), (False, True)),
                Config(param_persistence_threshold=0),
                (Call(0, True, 0, (Call(1, True, 1, (External((0,)),)),)),))

    def run() -> None:
        machine = QuietCallsMachine()
        machine.start(case)
        machine.run_pass(0, "complete", None)

    run()  # quiet only where nothing is freed: here no call is
    real = calls.call_tables

    def tables(spec, trainable, **kw):
        t = real(spec, trainable, **kw)
        return t._replace(quiet=t.inert)

    monkeypatch.setattr(calls, "call_tables", tables)
    with pytest.raises(SimError, match="I5 in backward"):
        run()
