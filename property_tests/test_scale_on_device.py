"""fp16's loss scale on the device (fz3/shell/device_scale.py) against its host transition
(fz3/core/grad/scaler.py update_scale, itself held to DeepSpeed's by the scaler machine), step by
step over drawn configs and overflow sequences: the same scale, good count and hysteresis, the
LossScaleError exactly where the host raises, and unscale_by alike. The teeth: planted bugs in
the device transition are caught (fixed settings, derandomized)."""
import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from fz3.config.config import Config
from fz3.core.grad import scaler
from fz3.shell import device_scale
from fz3.shell.device_scale import DeviceScale

CPU = torch.device("cpu")


@st.composite
def runs(draw):
    power, window, hysteresis = draw(st.integers(0, 20)), draw(st.integers(1, 5)), draw(st.integers(1, 4))
    config = Config(compute_dtype="fp16", initial_scale_power=power, loss_scale_window=window,
                    hysteresis=hysteresis, consecutive_hysteresis=draw(st.booleans()),
                    min_loss_scale=draw(st.sampled_from([0.5, 1, 4])))
    return config, draw(st.lists(st.sampled_from([False, False, False, True]), min_size=1, max_size=40))


def _check(config: Config, overflows: list[bool]) -> None:
    host, device = scaler.initial_scale(config), DeviceScale.of(scaler.initial_scale(config), CPU)
    for i, overflow in enumerate(overflows):
        assert float(device.unscale_by(config)) == scaler.unscale_by(host, config=config), (i, host)
        nxt, at_min = device.update(torch.tensor(float(overflow)), config)
        try:
            host = scaler.update_scale(host, overflow, config=config)
        except scaler.LossScaleError:
            assert bool(at_min), f"step {i}: the host raised at the minimum scale, the device did not say so"
            assert nxt.read() == device.read(), "the state moved where the host's stays"
            return
        assert not bool(at_min), f"step {i}: the device flagged the minimum, the host went on"
        device = nxt
        assert device.read() == host, (i, device.read(), host)


@settings(max_examples=300, deadline=None)
@given(runs())
def test_the_device_transition_is_the_hosts(run):
    _check(*run)


STRICT = settings(max_examples=300, deadline=None, database=None, derandomize=True,
                  phases=[Phase.explicit, Phase.generate], report_multiple_bugs=False)
_update = DeviceScale.update


def no_refill_on_growth(self, found_inf, config):
    """Planted: growth leaves the hysteresis as it was."""
    nxt, at_min = _update(self, found_inf, config)
    grew = nxt.scale > self.scale
    return nxt._replace(hysteresis=torch.where(grew, self.hysteresis, nxt.hysteresis)), at_min


def no_floor(self, found_inf, config):
    """Planted: the halved scale may go below min_loss_scale."""
    return _update(self, found_inf, config.replace(min_loss_scale=1e-30))


def good_not_reset(self, found_inf, config):
    """Planted: an overflow leaves the good count."""
    nxt, at_min = _update(self, found_inf, config)
    return nxt._replace(good=torch.where(found_inf > 0, self.good, nxt.good)), at_min


BUGS = {"hysteresis not refilled at growth": no_refill_on_growth, "no min_loss_scale floor": no_floor,
        "good count kept over an overflow": good_not_reset}


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_planted_bugs_are_caught(bug, monkeypatch):
    monkeypatch.setattr(device_scale.DeviceScale, "update", BUGS[bug])
    with pytest.raises(AssertionError):
        STRICT(given(runs())(lambda run: _check(*run)))()
