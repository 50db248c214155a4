"""fp16's loss scale (fz3/testing/scaler_machine.py) under the active profile, and its teeth: each
planted bug in fz3/core/grad/scaler.py is caught by the machine (fixed settings, derandomized)."""
import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from fz3.core.grad import scaler
from fz3.core.grad.scaler import LossScale
from fz3.testing.scaler_machine import ScalerMachine

TestScaler = ScalerMachine.TestCase

STRICT = settings(max_examples=300, deadline=None, database=None, derandomize=True,
                  phases=[Phase.explicit, Phase.generate], report_multiple_bugs=False)
_real = scaler.update_scale


def grows_a_step_early(state, overflow, *, config):
    """Planted: the scale doubles one good step before DeepSpeed's (good == window - 1)."""
    new = _real(state, overflow, config=config)
    if scaler.dynamic(config) and not overflow and state.good == config.loss_scale_window - 1 and new.scale == state.scale:
        return LossScale(state.scale * 2, 1, config.hysteresis)
    return new


def consecutive_ignored(state, overflow, *, config):
    """Planted: consecutive_hysteresis never refills the hysteresis."""
    return _real(state, overflow, config=config.replace(consecutive_hysteresis=False))


def no_floor(state, overflow, *, config):
    """Planted: the halved scale may drop below min_loss_scale."""
    new = _real(state, overflow, config=config.replace(min_loss_scale=1e-30))
    return new


def hysteresis_kept_at_growth(state, overflow, *, config):
    """Planted: the growth does not refill the hysteresis."""
    new = _real(state, overflow, config=config)
    return new._replace(hysteresis=state.hysteresis) if new.scale > state.scale else new


BUGS = {
    "growth one step early": (scaler, "update_scale", grows_a_step_early),
    "consecutive_hysteresis ignored": (scaler, "update_scale", consecutive_ignored),
    "no min_loss_scale floor": (scaler, "update_scale", no_floor),
    "hysteresis not refilled at growth": (scaler, "update_scale", hysteresis_kept_at_growth),
    "unscaled by the scale before the update": (scaler, "unscale_by", lambda state, *, config: state.scale),
}


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_machine_catches(bug, monkeypatch):
    module, attr, fn = BUGS[bug]
    monkeypatch.setattr(module, attr, fn)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(ScalerMachine, settings=STRICT)
