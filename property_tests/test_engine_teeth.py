"""Teeth for I7 at the engine's level: the drawn, bitwise property (test_engine_exact.py) must
catch deliberately broken arithmetic and timing, each within the examples allowed.

    (a) the boundary divides by W alone, not W x gradient_accumulation_steps
    (b) a leaf module is reduced at its first call's post-backward, before its other calls add
        their grads (the [Note: leaf modules] condition dropped)
    (c) a micro-step's partition write always copies (the accumulation of earlier micro-steps lost)
    (d) the step gives every trainable param a grad, zeros where none came (AdamW decays it)
    (e) a leaf's zeros standing in for an expert's missing grad count as a grad
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, given, settings

import fz3.core.calls as calls
import fz3.core.grad.epilogue as epilogue
import fz3.core.grad.grads as grads
from fz3.core.effects import COPY
from tests.support import drawn_nets as dn

HUNT = settings(max_examples=100, derandomize=True, database=None, deadline=None,
                phases=(Phase.generate,), report_multiple_bugs=False,
                suppress_health_check=list(HealthCheck))


def assert_caught(or_raises: type[Exception] | None = None) -> None:
    """The drawn property fails; `or_raises`: or the engine itself raises that error on a rank
    first (run_threads re-raises it as a RuntimeError from it)."""
    @HUNT
    @given(dn.nets(), dn.setups(stages=(3,)))
    def hunt(spec, setup):
        world, config, options = setup
        dn.check_on_threads(spec, world, config, options)

    with pytest.raises((AssertionError, RuntimeError) if or_raises else AssertionError) as caught:
        hunt()
    if caught.type is RuntimeError:
        assert isinstance(caught.value.__cause__, or_raises), caught.value


def test_dividing_by_the_world_size_alone_is_caught(monkeypatch):
    real = epilogue.grad_divisor
    monkeypatch.setattr(epilogue, "grad_divisor", lambda w, gas, predivide=1.0, **scale: real(w, 1, predivide, **scale))
    assert_caught()


def test_a_leaf_reduced_before_its_other_calls_is_caught(monkeypatch):
    real = calls._reduce_leaf

    def post_backward(st, ev, *, config):  # at any post_backward of a pending leaf
        m, with_grad = ev.module, ev.with_grad
        cs, effects = calls._in_backward(st.calls)
        g = st.grads
        if m in cs.leaves:
            cs, g, eff = real(cs, g, m, config, with_grad)
            effects += eff
        params, eff = calls.core_bwd.release_after_backward(st.params, m, config=config)
        cs, params, eff2 = calls._end_waiting(cs, params, m, config)
        return calls.Lifecycle(params, g, cs), effects + eff + eff2

    monkeypatch.setattr(calls, "post_backward", post_backward)
    # the later calls' grads stay in the leaf's .grad: the next forward takes them for a backward
    # that sent no end ([Note: persistent grads at the end of backward]), one micro-step too many
    assert_caught(or_raises=grads.GradError)


def test_writes_that_always_copy_are_caught(monkeypatch):
    monkeypatch.setattr(grads, "write_mode", lambda pg, window: COPY)
    assert_caught()


def test_a_step_that_gives_every_param_a_grad_is_caught(monkeypatch):
    monkeypatch.setattr(calls, "no_grad_params", lambda st, leaf_grads=None: ())
    assert_caught()


def test_zeros_standing_in_for_a_grad_counted_as_one_are_caught(monkeypatch):
    real = grads.bucket_add
    monkeypatch.setattr(calls, "bucket_add", lambda *a, stand_in=False, **k: real(*a, **k))
    assert_caught()
