"""A non-finite gradient never reaches the weights ([Note: a step skipped], fz3/core/grad/epilogue.py).

One rank's loss is NaN (or inf) at the second of four steps: after that step every rank's
params, optimizer state and learning rate are what they were before it, was_step_applied() is
False, stats()["skipped_steps"] is 1, and every rank logs a WARNING naming the step and the
first param, in model order, whose averaged gradient is not finite. The run goes on and equals
plain PyTorch that skipped that batch, bit for bit (exact data, SGD). The search for the param
runs only when the norm is not finite.
"""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from fz3 import launch

pytestmark = pytest.mark.timeout(300)

LR, STEPS, BAD = 2.0 ** -4, 4, 1  # the step (0-based) whose loss is not finite on one rank


class Net(nn.Module):
    """A frozen first layer (its grad is None: no NaN there), then two trainable ones."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.frozen, self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randint(-1, 2, p.shape, generator=g).float())
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.b(torch.relu(self.a(torch.relu(self.frozen(x)))))


def batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(-1, 2, (2, 4), generator=g).float()


def _train(rank: int, world: int, bad: float) -> dict:
    import fz3
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    engine = fz3.initialize(model, opt, fz3.Config(param_persistence_threshold=0), lr_scheduler=sched)
    out = {"applied": [], "skipped": [], "lr": [], "before": None, "after_bad": None}
    for step in range(STEPS):
        loss = engine(batch(step, rank)).sum()
        if step == BAD and rank == world - 1:
            loss = loss * bad  # NaN or inf on the last rank only
        engine.backward(loss)
        if step == BAD:
            out["before"] = (engine.full_state_dict(), [m.detach().clone() for m in engine.store.masters],
                             {k: v["momentum_buffer"].clone() for k, v in enumerate(opt.state.values())})
        engine.step()
        if step == BAD:
            out["after_bad"] = (engine.full_state_dict(), [m.detach().clone() for m in engine.store.masters],
                                {k: v["momentum_buffer"].clone() for k, v in enumerate(opt.state.values())})
        out["applied"].append(engine.was_step_applied())
        out["skipped"].append(engine.stats()["skipped_steps"])
        out["lr"].append(engine.get_lr()[0])
    out["state"] = engine.full_state_dict()
    out["norm"] = engine.get_global_grad_norm()
    return out


def _reference() -> dict:
    """Plain PyTorch, both ranks' rows, the bad step's batch skipped."""
    model = Net()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR, momentum=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    for step in range(STEPS):
        if step == BAD:
            continue
        opt.zero_grad()
        for r in range(2):
            model(batch(step, r)).sum().backward()
        for p in model.parameters():
            if p.grad is not None:
                p.grad /= 2
        opt.step()
        sched.step()
    return model.state_dict()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_one_ranks_non_finite_loss_skips_the_step_on_every_rank(bad, caplog):
    with caplog.at_level(logging.WARNING, logger="fz3"):
        outs = launch.run_threads(_train, 2, args=(bad,))
    for r, out in enumerate(outs):
        assert out["applied"] == [True, False, True, True], r
        assert out["skipped"] == [0, 1, 1, 1], r
        assert out["lr"] == [LR / 2, LR / 2, LR / 4, LR / 8], r  # the scheduler skipped the bad step too
        before, after = out["before"], out["after_bad"]
        for k in before[0]:
            assert torch.equal(before[0][k], after[0][k]), k
        for a, b in zip(before[1], after[1]):
            assert torch.equal(a, b)
        assert before[2].keys() == after[2].keys() and all(torch.equal(before[2][k], after[2][k]) for k in before[2])
    skipped = [rec.getMessage() for rec in caplog.records if "skipped" in rec.getMessage()]
    assert len(skipped) == 2, skipped  # every rank says so, once
    for r, msg in enumerate(sorted(skipped)):
        assert f"rank {r}: optimizer step {BAD + 1} skipped" in msg and "'a.weight'" in msg, msg
        assert ("nan" if bad != bad else "inf") in msg, msg
    ref = _reference()
    for k, v in ref.items():
        assert torch.equal(outs[0]["state"][k], v), k  # the run went on as if the batch was not there


def _train_3(rank: int, world: int) -> dict:
    """Three ranks; the middle one's grad for b.bias only is NaN (a NaN in one param)."""
    import fz3
    model = Net()
    engine = fz3.initialize(model, torch.optim.AdamW(model.parameters(), lr=LR), fz3.Config())
    loss = engine(batch(0, rank)).sum()
    if rank == 1:
        loss = loss + model.b.bias.sum() * float("nan")
    engine.backward(loss)
    engine.step()
    return {"applied": engine.was_step_applied(), "state": engine.full_state_dict(),
            "opt_state": len(engine.optimizer.state)}


def test_the_warning_names_the_first_param_with_a_non_finite_grad_in_model_order(caplog):
    with caplog.at_level(logging.WARNING, logger="fz3"):
        outs = launch.run_threads(_train_3, 3)
    assert [o["applied"] for o in outs] == [False] * 3
    assert [o["opt_state"] for o in outs] == [0] * 3  # AdamW never stepped: no state at all
    init = Net().state_dict()
    for k, v in init.items():
        assert torch.equal(outs[0]["state"][k], v), k
    msgs = [rec.getMessage() for rec in caplog.records if "skipped" in rec.getMessage()]
    assert len(msgs) == 3 and all("'b.bias'" in m and "optimizer step 1 skipped" in m for m in msgs), msgs


def _finite(rank: int, world: int) -> int:
    import fz3
    model = Net()
    engine = fz3.initialize(model, torch.optim.SGD(model.parameters(), lr=LR), fz3.Config())
    for step in range(2):
        engine.backward(engine(batch(step, rank)).sum())
        engine.step()
    return engine.stats()["skipped_steps"]


def _never(*args, **kwargs):
    raise AssertionError("first_nonfinite ran at a finite step")


def test_a_finite_step_never_searches_for_the_param(monkeypatch):
    from fz3.shell import engine as engine_module
    monkeypatch.setattr(engine_module, "first_nonfinite", _never)  # the thread ranks share the module
    assert launch.run_threads(_finite, 2) == [0, 0]


def _gloo(rank: int, world: int) -> dict:
    out = _train(rank, world, float("nan"))
    return {"applied": out["applied"], "skipped": out["skipped"], "state": out["state"]}


def test_on_gloo_processes_too():
    outs = launch.run(_gloo, world_size=2, timeout=120)
    ref = _reference()
    for out in outs:
        assert out["applied"] == [True, False, True, True] and out["skipped"] == [0, 1, 1, 1]
        for k, v in ref.items():
            assert torch.equal(out["state"][k], v), k
