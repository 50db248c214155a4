"""The fp16 loss scale: a pure transition at each accumulation boundary, DeepSpeed's rules.

                 overflow (a grad not finite on some rank: the step is skipped)
                   hysteresis left > 1:   hysteresis - 1, the scale stays
                   else:                  scale / 2 (not below min_loss_scale; at it: an error)
    LossScale  --------------------------------------------------------------->  good = 0
    (scale, good, hysteresis)
                 no overflow (the step applied)
                   good == loss_scale_window:  scale x 2, hysteresis refilled
                   consecutive_hysteresis:     hysteresis refilled every such step
    LossScale  --------------------------------------------------------------->  good = good % window + 1

In fp16 the loss is divided by gradient_accumulation_steps and multiplied by the scale before
its backward (DeepSpeed's engine.backward: loss / gas, then loss_scaler.scale_loss), so small
grads do not flush to zero in fp16; the boundary divides the summed grads by W x scale
(fz3/core/grad/epilogue.py, grad_divisor), which unscales them ([Note: unscaled by the grown
scale]). A grad that overflowed fp16
anywhere reaches every partition as inf or NaN through the reduce, so "overflow" is the global
grad norm not being finite, the same bit on every rank ([Note: a step skipped], epilogue.py).

[Note: the scaler's count] DeepSpeed counts iterations (cur_iter, last_overflow_iter) and grows
the scale when `stable = cur_iter - last_overflow_iter - 1` is a positive multiple of
loss_scale_window. Only that count round the window matters, so `good` holds it: 0 right after
an overflow (and at the start), else ((stable - 1) mod window) + 1, in 1..window; the scale
grows where `good == window`. The engine keeps this record in a cell of its own, beside the
core's Lifecycle: `good` moves every step, and inside the Lifecycle it would make every
pass's state new, so no recorded pass could be replayed (fz3/core/replay.py). The scale enters
the lifecycle through the StepCalled event, which a replay compares: a pass recorded at one
scale is replayed until the scale moves.

[Note: unscaled by the grown scale] DeepSpeed 0.19.8 updates the scale before it unscales the
grads (stage_1_and_2.py / stage3.py step: `_update_scale`, then `unscale_and_clip_grads` with
the new `loss_scale`), so on a step where the scale doubles the grads are divided by twice the
scale that multiplied them: that step's update is made with half the gradient (clipped as
half), and stage 3 reports half the grad norm. torch's GradScaler unscales first. fz3 keeps
DeepSpeed's order, so that a DeepSpeed fp16 config trains here as it trains there (losses
within 3e-4 of DeepSpeed's over 28 micro-steps with four growths, tests/test_loss_scale.py;
unscaled by the scale that scaled, they drifted 3.5e-3 after the first growth): the boundary
divides by `unscale_by`, the scale after this step's update if the step applies (a skipped
step's grads are not used). With the default loss_scale_window of 1000 it is one step in a
thousand.

With a fused optimizer the same transition runs on the device, in tensor ops over the same
record (fz3/shell/device_scale.py, held to `update_scale` by property_tests/test_scale_on_device.py):
[Note: the verdict on the device], fz3/core/grad/verdict.py.

DeepSpeed: runtime/fp16/loss_scaler.py DynamicLossScaler.update_scale and LossScaler (static).
"""
from __future__ import annotations

from typing import NamedTuple

from fz3.config.config import Config


class LossScaleError(RuntimeError):
    """The loss scale is at min_loss_scale and the grads overflowed again."""


class LossScale(NamedTuple):
    """The scaler's state ([Note: the scaler's count]). A static scale never moves."""

    scale: float  # what the loss is multiplied by before backward (1.0 outside fp16)
    good: int  # steps without overflow, counted round loss_scale_window (0: none since the last)
    hysteresis: int  # overflows still allowed before the scale halves


def initial_scale(config: Config) -> LossScale:
    """fp16 dynamic: 2 ** initial_scale_power; fp16 static: loss_scale; else 1.0 (nothing)."""
    if config.compute_dtype != "fp16":
        return LossScale(1.0, 0, config.hysteresis)
    if config.loss_scale:
        return LossScale(float(config.loss_scale), 0, config.hysteresis)
    return LossScale(float(2 ** config.initial_scale_power), 0, config.hysteresis)


def dynamic(config: Config) -> bool:
    """The scale moves: fp16 with loss_scale 0 (DeepSpeed: dynamic_loss_scale)."""
    return config.compute_dtype == "fp16" and not config.loss_scale


def update_scale(state: LossScale, overflow: bool, *, config: Config) -> LossScale:
    """The boundary's verdict: `overflow` (the step was skipped) or not. A static or non-fp16
    scale stays. Raises LossScaleError where DeepSpeed raises: an overflow that would halve a
    scale already at min_loss_scale.
    DeepSpeed: DynamicLossScaler.update_scale (scale_factor 2)."""
    if not dynamic(config):
        return state
    scale, good, hysteresis = state
    if overflow:
        if config.hysteresis == 1 or hysteresis == 1:
            if scale == config.min_loss_scale:
                raise at_minimum(config)
            return LossScale(max(scale / 2, float(config.min_loss_scale)), 0, hysteresis)
        return LossScale(scale, 0, hysteresis - 1)
    if config.consecutive_hysteresis:
        hysteresis = config.hysteresis
    if good == config.loss_scale_window:
        return LossScale(scale * 2, 1, config.hysteresis)
    return LossScale(scale, good % config.loss_scale_window + 1, hysteresis)


def at_minimum(config: Config) -> LossScaleError:
    """The error of an overflow at min_loss_scale (raised at once on the host, a step late with
    the scale on the device: fz3/shell/device_scale.py)."""
    return LossScaleError(
        f"fp16: the grads overflowed again at the minimum loss scale {config.min_loss_scale!r} "
        "(fp16.min_loss_scale), so the scale cannot halve: the model's grads do not fit fp16 at "
        "any allowed scale. Lower fp16.min_loss_scale, lower the learning rate or the loss's size, "
        "or train in bf16 ('bf16': {'enabled': true}). DeepSpeed stops here too: 'Current loss scale "
        "already at minimum - cannot decrease scale anymore. Exiting run.'")


def unscale_by(state: LossScale, *, config: Config) -> float:
    """What the boundary divides the grads by, beside W: the scale this step leaves if it
    applies ([Note: unscaled by the grown scale]), twice the scale at a growth step."""
    if dynamic(config) and state.good == config.loss_scale_window:
        return state.scale * 2
    return state.scale


def reported_norm_factor(state: LossScale, *, config: Config) -> float:
    """What the norm of the unscaled grads is multiplied by for get_global_grad_norm: on a growth
    step DeepSpeed's stages 1 and 2 report the norm divided by the scale before the update, its
    stage 3 by the grown one, as it unscales ([Note: unscaled by the grown scale]); 1 otherwise.
    DeepSpeed: stage_1_and_2.py step (`_global_grad_norm = scaled_global_norm / prev_scale`),
    stage3.py step (`/ self.loss_scale`)."""
    if config.stage == 3:
        return 1.0
    return unscale_by(state, config=config) / state.scale


def loss_factor(state: LossScale, *, config: Config) -> float | None:
    """What engine.backward does to the loss in fp16: / gas, then x scale (None outside fp16,
    where the loss goes in as it is and the boundary divides by W x gas). DeepSpeed:
    engine.backward (scale_wrt_gas) and scale_if_loss."""
    return state.scale if config.compute_dtype == "fp16" else None
