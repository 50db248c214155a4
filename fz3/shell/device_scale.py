"""fp16's dynamic loss scale kept on the device, so a step never reads it ([Note: the verdict on
the device], fz3/core/grad/verdict.py; the scale's rules: fz3/core/grad/scaler.py).

fz3/core/grad/scaler.py `update_scale` is the transition, DeepSpeed's rules in plain Python. Here
the same transition is written in tensor ops over the scale, the good steps and the hysteresis
left as 0-dim device tensors, driven by the norm's `found_inf` flag instead of a bool the host
read: `update` returns the next state and whether the scale was at its minimum and overflowed
again (LossScaleError, raised once that flag is read, a step late).
property_tests/test_scale_on_device.py holds it to `scaler.update_scale` step by step.

    DeviceScale.of(state, device)   the tensors of a LossScale
    loss(loss, gas)                 engine.scale's loss / gas x scale, in the loss's dtype
    unscale_by()                    the scale this step leaves if it applies (scaler.unscale_by)
    update(found_inf, config)       -> (next DeviceScale, at_min: the LossScaleError flag)
    read()                          -> LossScale (a host read: checkpoints, stats, the log)
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from fz3.config.config import Config
from fz3.core.grad.scaler import LossScale


class DeviceScale(NamedTuple):
    scale: torch.Tensor  # () float32: a power of two unless min_loss_scale is not one
    good: torch.Tensor  # () int64
    hysteresis: torch.Tensor  # () int64

    @classmethod
    def of(cls, state: LossScale, device: torch.device) -> "DeviceScale":
        return cls(torch.tensor(state.scale, dtype=torch.float32, device=device),
                   torch.tensor(state.good, dtype=torch.int64, device=device),
                   torch.tensor(state.hysteresis, dtype=torch.int64, device=device))

    def read(self) -> LossScale:
        return LossScale(float(self.scale), int(self.good), int(self.hysteresis))

    def loss(self, loss: torch.Tensor, gas: int) -> torch.Tensor:
        """loss / gas x scale in the loss's own dtype, as a Python float scale multiplies it
        (in float32, rounded once to the loss's dtype): scaler.loss_factor's, bit for bit."""
        scaled = loss / gas
        return (scaled.float() * self.scale).to(scaled.dtype)

    def unscale_by(self, config: Config) -> torch.Tensor:
        """scaler.unscale_by: twice the scale where this step's growth comes ([Note: unscaled by
        the grown scale])."""
        return torch.where(self.good == config.loss_scale_window, self.scale * 2, self.scale)

    def update(self, found_inf: torch.Tensor, config: Config) -> tuple["DeviceScale", torch.Tensor]:
        """scaler.update_scale with `overflow` the 0-dim float flag found_inf (1.0: not finite)."""
        overflow = found_inf > 0
        halve = overflow & ((self.hysteresis == 1) | (config.hysteresis == 1))
        at_min = halve & (self.scale == config.min_loss_scale)
        grow = ~overflow & (self.good == config.loss_scale_window)
        scale = torch.where(halve, torch.clamp(self.scale / 2, min=config.min_loss_scale),
                            torch.where(grow, self.scale * 2, self.scale))
        full = torch.full_like(self.hysteresis, config.hysteresis)
        refill = grow | (~overflow & config.consecutive_hysteresis)
        hysteresis = torch.where(overflow, torch.where(halve, self.hysteresis, self.hysteresis - 1),
                                 torch.where(refill, full, self.hysteresis))
        good = torch.where(overflow, torch.zeros_like(self.good),
                           torch.where(grow, torch.ones_like(self.good), self.good % config.loss_scale_window + 1))
        # at the minimum the host raises and leaves the state as it was: so does this one
        return DeviceScale(torch.where(at_min, self.scale, scale), torch.where(at_min, self.good, good),
                           torch.where(at_min, self.hysteresis, hysteresis)), at_min
