"""fp16's dynamic loss scale on the device (fz3/shell/device_scale.py; [Note: the verdict on the
device]): with a fused optimizer the scale, its good steps and its hysteresis stay device
tensors, the loss is scaled and the grads unscaled by them, and the scale's moves are read a
step late.

Each run is held against the same run with the verdict and the scale read at each boundary
(scaler.update_scale on the host), forced on the same fused optimizer. fp16 loss scales are
powers of two, so the grads divided by W and then by the scale are the grads divided by W x
scale, bit for bit: masters, optimizer state, the scale at every step, the skipped steps and the
INFO lines are equal. The loss is multiplied so that it overflows fp16 at the chosen steps: the
scale halves, spends its hysteresis and grows back (loss_scale_window 2).
"""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import fz3
from fz3 import launch
from fz3.core.grad.scaler import LossScale

pytestmark = pytest.mark.timeout(300)

STEPS = 9
OVERFLOW = {1: 1e30, 2: 1e30, 7: 1e30}  # the steps whose loss overflows fp16 (on rank 1 only)
CONFIG = dict(compute_dtype="fp16", param_persistence_threshold=0, initial_scale_power=8, loss_scale_window=2,
              hysteresis=2, gradient_clipping=1.0)


def _train(rank: int, world: int, on_host: bool, config: dict = CONFIG) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.9 ** s)
    engine = fz3.initialize(model, optimizer, fz3.Config(**config), lr_scheduler=sched)
    assert engine.device_scale is not None
    if on_host:
        engine.verdict_on_host, engine.device_scale = "forced by the test", None
    g = torch.Generator().manual_seed(rank)
    out = {"scale": [], "skipped": [], "lr": []}
    for step in range(STEPS):
        loss = engine(torch.randn(4, 8, generator=g)).float().square().mean()
        if rank == world - 1 and step in OVERFLOW:
            loss = loss * OVERFLOW[step]
        engine.backward(loss)
        engine.step()
        out["scale"].append(tuple(engine.loss_scale))
        out["skipped"].append(engine.stats()["skipped_steps"])
        out["lr"].append(engine.get_lr())
    out["masters"] = [m.detach().clone() for m in engine.store.masters]
    out["norm"] = engine.get_global_grad_norm()
    return out


def test_the_scale_on_the_device_trains_as_the_scale_on_the_host(caplog):
    with caplog.at_level(logging.INFO, logger="fz3"):
        host = launch.run_threads(_train, 2, args=(True,))
        said_host = [r.getMessage() for r in caplog.records if "loss scale" in r.getMessage()]
        caplog.clear()
        device = launch.run_threads(_train, 2, args=(False,))
        said_device = [r.getMessage() for r in caplog.records if "loss scale" in r.getMessage()]
    for d, h in zip(device, host):
        assert (d["scale"], d["skipped"], d["lr"], d["norm"]) == (h["scale"], h["skipped"], h["lr"], h["norm"])
        assert all(torch.equal(a, b) for a, b in zip(d["masters"], h["masters"]))
    scales = [s for s, _, _ in host[0]["scale"]]
    assert 128 in scales and scales.index(128) < len(scales) - 1 - scales[::-1].index(256), scales  # halved, grew
    assert host[0]["skipped"][-1] == 3
    assert sorted(said_device) == sorted(said_host) and len(said_host) >= 3, said_host  # read a step late


def _at_minimum(rank: int, world: int, on_host: bool) -> dict:
    """Every step overflows at min_loss_scale 256 = the initial scale, hysteresis 1: the first
    overflow cannot halve. The host raises at that step; the device at the next boundary."""
    config = dict(CONFIG, initial_scale_power=8, min_loss_scale=256, hysteresis=1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4))
    engine = fz3.initialize(model, torch.optim.AdamW(model.parameters(), fused=True), fz3.Config(**config))
    if on_host:
        engine.verdict_on_host, engine.device_scale = "forced by the test", None
    for step in range(3):
        engine.backward(engine(torch.ones(2, 8)).float().sum() * 1e30)
        try:
            engine.step()
        except Exception as e:  # noqa: BLE001 - the error under test
            return {"step": step, "error": f"{type(e).__name__}: {e}", "scale": tuple(engine.loss_scale)}
    return {"step": None}


def test_an_overflow_at_the_minimum_scale_raises_as_deepspeed_a_step_later():
    host = launch.run_threads(_at_minimum, 2, args=(True,))
    device = launch.run_threads(_at_minimum, 2, args=(False,))
    for h, d in zip(host, device):
        assert h["step"] == 0 and d["step"] == 1, (h, d)
        assert h["error"] == d["error"] and "LossScaleError" in h["error"] and "minimum loss scale 256" in h["error"]
        assert h["scale"] == d["scale"] == (256.0, 0, 1)


def test_a_checkpoint_keeps_the_device_scale(tmp_path):
    def save_and_load(rank: int, world: int):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        engine = fz3.initialize(model, torch.optim.AdamW(model.parameters(), fused=True), fz3.Config(**CONFIG))
        engine.loss_scale = LossScale(32.0, 1, 1)
        engine.save_checkpoint(str(tmp_path), tag="t")
        model2 = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        other = fz3.initialize(model2, torch.optim.AdamW(model2.parameters(), fused=True), fz3.Config(**CONFIG))
        other.load_checkpoint(str(tmp_path), tag="t")
        return tuple(other.loss_scale), float(other.device_scale.scale)
    for scale, on_device in launch.run_threads(save_and_load, 2):
        assert scale == (32.0, 1, 1) and on_device == 32.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_the_loss_is_scaled_as_a_python_float_scales_it(dtype):
    from fz3.shell.device_scale import DeviceScale
    g = torch.Generator().manual_seed(0)
    for scale in (1.0, 2.0 ** 8, 2.0 ** 15, 2.0 ** 16, 0.5):
        loss = (torch.randn((), generator=g) * 300).to(dtype)
        want = loss / 3 * scale
        got = DeviceScale.of(LossScale(scale, 0, 2), torch.device("cpu")).loss(loss, 3)
        assert got.dtype == want.dtype and torch.equal(got, want), (scale, got, want)
