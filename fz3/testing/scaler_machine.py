"""fp16's loss scale as a Hypothesis state machine, against DeepSpeed's own algorithm.

    initialize   a config: dynamic or static, initial_scale_power 0-20, loss_scale_window 1-5,
                 hysteresis 1-4, consecutive_hysteresis, min_loss_scale 0.5 / 1 / 4
    rules        boundary(overflow): fz3.core.grad.scaler.update_scale against NaiveScaler
    checks       after every boundary the scale and the hysteresis left are the naive model's;
                 LossScaleError exactly where the naive model raises; before every boundary
                 that applies, `unscale_by` is the scale the step leaves ([Note: unscaled by the
                 grown scale])

The naive model is DeepSpeed 0.19.8's DynamicLossScaler.update_scale transcribed as it is, with
its unbounded counters (cur_iter, last_overflow_iter), which fz3's `good` replaces by the count
round the window ([Note: the scaler's count], fz3/core/grad/scaler.py).
Reuse: `TestScaler = ScalerMachine.TestCase`.
"""
from __future__ import annotations

import fz3.testing.extra  # noqa: F401 - Hypothesis, or an ImportError naming the test extra
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from fz3.config.config import Config
from fz3.core.grad import scaler
from fz3.testing.coverage import covered


class NaiveScaler:
    """DeepSpeed's DynamicLossScaler (runtime/fp16/loss_scaler.py), line for line; a static
    scale never moves."""

    def __init__(self, config: Config) -> None:
        self.dynamic = not config.loss_scale
        self.cur_scale = float(config.loss_scale or 2 ** config.initial_scale_power)
        self.cur_iter, self.last_overflow_iter = 0, -1
        self.scale_window, self.min_scale = config.loss_scale_window, config.min_loss_scale
        self.delayed_shift = self.cur_hysteresis = config.hysteresis
        self.consecutive_hysteresis = config.consecutive_hysteresis

    def update_scale(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale:
                    raise RuntimeError("Current loss scale already at minimum")
                self.cur_scale = max(self.cur_scale / 2.0, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
            if stable_interval > 0 and stable_interval % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= 2.0
        self.cur_iter += 1


class ScalerMachine(RuleBasedStateMachine):
    @initialize(dynamic=st.sampled_from([True, True, True, False]), power=st.integers(0, 20),
                window=st.integers(1, 5), hysteresis=st.integers(1, 4), consecutive=st.booleans(),
                low=st.sampled_from([0.5, 1, 4]))
    def setup(self, dynamic: bool, power: int, window: int, hysteresis: int, consecutive: bool, low: float) -> None:
        self.config = Config(compute_dtype="fp16", loss_scale=0 if dynamic else 2.0 ** power,
                             initial_scale_power=power, loss_scale_window=window, hysteresis=hysteresis,
                             consecutive_hysteresis=consecutive, min_loss_scale=low)
        self.state = scaler.initial_scale(self.config)
        self.naive = NaiveScaler(self.config)
        note(f"{self.config}")
        covered("examples", "loss scale")

    @precondition(lambda self: hasattr(self, "state"))
    @rule(overflow=st.sampled_from([False, False, False, True]))
    def boundary(self, overflow: bool) -> None:
        note(f"boundary: {'overflow' if overflow else 'applied'}")
        unscale = scaler.unscale_by(self.state, config=self.config)
        try:
            self.naive.update_scale(overflow)
        except RuntimeError:
            try:
                scaler.update_scale(self.state, overflow, config=self.config)
            except scaler.LossScaleError:
                covered("misuse refused", "loss scale at its minimum overflowed again")
                note("  -> LossScaleError, as DeepSpeed's Exception: the run starts again")
                self.state, self.naive = scaler.initial_scale(self.config), NaiveScaler(self.config)
                return
            raise AssertionError("the naive scaler stopped at its minimum scale; fz3's went on")
        before = self.state
        self.state = scaler.update_scale(self.state, overflow, config=self.config)
        note(f"  -> {self.state}")
        if not overflow:
            assert unscale == self.state.scale, (
                f"unscale_by said {unscale} before a step that applied; the step left the scale at {self.state.scale}")
        if self.state.scale > before.scale:
            covered("loss scale", "grew after a window without overflow")
        elif self.state.scale < before.scale:
            covered("loss scale", "halved")
        elif overflow and scaler.dynamic(self.config):
            covered("loss scale", "hysteresis spent")

    @invariant()
    def agrees(self) -> None:
        if hasattr(self, "state"):
            assert self.state.scale == self.naive.cur_scale, (self.state, self.naive.cur_scale)
            if scaler.dynamic(self.config):
                assert self.state.hysteresis == self.naive.cur_hysteresis, (self.state, self.naive.cur_hysteresis)
