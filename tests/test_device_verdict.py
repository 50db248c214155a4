"""The skip of a non-finite step decided on the device ([Note: the verdict on the device],
fz3/core/grad/verdict.py): with a fused torch optimizer the boundary never reads the grad norm;
the optimizer takes its flag, and the flag is read a step late.

Each run here is held against the same run with the verdict read at each boundary (the path of an
optimizer that cannot take it), forced on the same fused optimizer: the same kernels, so the
masters, the optimizer state, the learning rates and the counts are equal bit for bit, by
construction. One rank's loss is NaN at step BAD; an lr scheduler halves the lr every step, so
a scheduler step not put back after the skip shows in every later lr.
"""
from __future__ import annotations

import functools
import logging
import types

import pytest
import torch
from torch import nn

import fz3
from fz3 import launch
from fz3.shell import log
from fz3.shell.verdict import on_device

pytestmark = pytest.mark.timeout(300)

STEPS, BAD = 5, 2
OPTIMIZERS = {
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "Adam amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, fused=True),
    "SGD momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True),
}


def _net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))
    net[0].requires_grad_(False)  # the first param with a grad is '2.weight'
    return net


def _train(rank: int, world: int, opt: str, on_host: bool, *, read_early: bool = False,
           save: str | None = None) -> dict:
    model = _net()
    optimizer = OPTIMIZERS[opt]([p for p in model.parameters() if p.requires_grad])
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 ** s)
    engine = fz3.initialize(model, optimizer, fz3.Config(param_persistence_threshold=0, gradient_clipping=1.0),
                            lr_scheduler=sched)
    assert engine.verdict_on_host is None, engine.verdict_on_host
    if on_host:
        engine.verdict_on_host = "forced by the test"
    g = torch.Generator().manual_seed(rank)
    out = {"applied": [], "lr": [], "skipped": []}
    for step in range(STEPS):
        loss = engine(torch.randn(4, 8, generator=g)).square().mean()
        if step == BAD and rank == world - 1:
            loss = loss * float("nan")
        engine.backward(loss)
        engine.step()
        if step == BAD and read_early:
            out["early"] = engine.was_step_applied()
        if step == BAD and save:
            engine.save_checkpoint(save, tag="skipped")
        out["applied"].append(engine.was_step_applied())
        out["lr"].append(engine.get_lr())
        out["skipped"].append(engine.stats()["skipped_steps"])
    out["masters"] = [m.detach().clone() for m in engine.store.masters]
    out["state"] = [{k: v.clone() for k, v in s.items()} for s in optimizer.state.values()]
    return out


def _same(a: dict, b: dict) -> None:
    assert (a["applied"], a["lr"], a["skipped"]) == (b["applied"], b["lr"], b["skipped"])
    assert all(torch.equal(x, y) for x, y in zip(a["masters"], b["masters"]))
    assert len(a["state"]) == len(b["state"]) > 0
    for s, t in zip(a["state"], b["state"]):
        assert s.keys() == t.keys() and all(torch.equal(s[k], t[k]) for k in s)


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_the_skip_decided_on_the_device_equals_it_read_at_once(opt):
    device = launch.run_threads(_train, 2, args=(opt, False))
    host = launch.run_threads(_train, 2, args=(opt, True))
    for d, h in zip(device, host):
        _same(d, h)
    assert device[0]["applied"] == [True, True, False, True, True]
    assert device[0]["skipped"] == [0, 0, 1, 1, 1]
    assert device[0]["lr"][BAD] == device[0]["lr"][BAD - 1]  # the skip's scheduler step put back


def test_the_warning_names_the_param_a_step_late_once(caplog):
    with caplog.at_level(logging.WARNING, logger="fz3"):
        launch.run_threads(_train, 2, args=("AdamW", True))
        host = sorted(r.getMessage() for r in caplog.records)
        caplog.clear()
        launch.run_threads(functools.partial(_train, read_early=True), 2, args=("AdamW", False))
        device = sorted(r.getMessage() for r in caplog.records)
    assert len(host) == 2 and "'2.weight' is the first" in host[0] and "optimizer step 3 skipped" in host[0]
    assert device == host  # the same words, norm included, though read a step late (and early, by the user)


def test_a_users_read_right_after_the_skip_reads_it():
    out = launch.run_threads(functools.partial(_train, read_early=True), 2, args=("AdamW", False))
    assert [o["early"] for o in out] == [False, False]
    _same(out[0], launch.run_threads(_train, 2, args=("AdamW", True))[0])


def test_a_checkpoint_right_after_the_skip_holds_the_scheduler_put_back(tmp_path):
    launch.run_threads(functools.partial(_train, save=str(tmp_path)), 2, args=("AdamW", False))

    def resume(rank: int, world: int):
        model = _net()
        optimizer = OPTIMIZERS["AdamW"]([p for p in model.parameters() if p.requires_grad])
        sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 ** s)
        engine = fz3.initialize(model, optimizer, fz3.Config(param_persistence_threshold=0), lr_scheduler=sched)
        engine.load_checkpoint(str(tmp_path), tag="skipped")
        return engine.get_lr(), engine.stats()["skipped_steps"], engine.optimizer_steps

    host = launch.run_threads(_train, 2, args=("AdamW", True))
    for lr, skipped, steps in launch.run_threads(resume, 2):
        assert (lr, skipped, steps) == (host[0]["lr"][BAD], 1, BAD + 1)


def test_which_optimizers_take_the_verdict():
    ps = [nn.Parameter(torch.zeros(3))]
    assert on_device(torch.optim.AdamW(ps, fused=True), fz3.Config(), host_step=False) is None
    assert on_device(torch.optim.SGD(ps, lr=0.1, fused=True), fz3.Config(compute_dtype="bf16"), host_step=False) is None
    why = on_device(torch.optim.AdamW(ps), fz3.Config(), host_step=False)
    assert "torch.optim.adamw.AdamW cannot take the verdict" in why and "fused=True" in why
    for fp16 in (fz3.Config(compute_dtype="fp16"), fz3.Config(compute_dtype="fp16", loss_scale=128)):
        assert on_device(torch.optim.AdamW(ps, fused=True), fp16, host_step=False) is None  # the scale too
    assert "on the host" in on_device(torch.optim.AdamW(ps, fused=True), fz3.Config(), host_step=True)


def test_an_accelerator_run_names_the_sync_once(caplog):
    def engine(kind, rank=0):
        return types.SimpleNamespace(rank=rank, accelerator=types.SimpleNamespace(type=kind))
    with caplog.at_level(logging.INFO, logger="fz3"):
        log.verdict_on_host(engine("cuda"), "why")
        log.verdict_on_host(engine("cuda", rank=1), "why")
        log.verdict_on_host(engine("cpu"), "why")
        log.verdict_on_host(engine("npu"), None)
    assert [r.getMessage() for r in caplog.records] == [
        "fz3: each optimizer step reads its grad norm's finiteness on the host (one host-device sync a step, so "
        "the host cannot run ahead of the cuda): why"]
