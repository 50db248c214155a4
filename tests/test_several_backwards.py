"""Several backwards before one step(), and several engines in one process, at parity with plain
PyTorch ([Note: the window closes at step()], [Note: zero_grad in a window],
fz3/core/grad/epilogue.py).

    the GAN of DeepSpeedExamples (training/gan): two engines, D and G; per iteration
        netD.zero_grad(); D.backward(D(real)); D.backward(D(G(z).detach())); D.step()
        netG.zero_grad(); G.backward(D(G(z)));  G.step()
    against the same loop on one process, the whole batch, torch's optimizers: every param of
    both nets after each iteration. The generator's backward leaves grads in D's params, which
    the next zero_grad drops in plain PyTorch: fz3 drops them whichever zero_grad the script
    calls (the model's, the optimizer's or the engine's).

    two backwards per micro-step at gas 1 and 2, managed_gradient_accumulation false (a step()
    after any number of backwards), coalesce_grad_reduction and set_gradient_accumulation_boundary:
    the same params as plain PyTorch summing the same losses, each / gas, into one step.

Data are small integers, the nets linear layers with ReLU and an MSE loss summed, the
optimizer SGD with power-of-two hyperparameters. After a step the weights carry more bits, and
a grad through two layers multiplies several of them past fp32's 24: each rank's sum, then the
sum over ranks, rounds differently from one process's sum over the whole batch, by an ulp or
two. So values are compared at atol 1e-6 (weights of magnitude <= 4): what the tests guard is
orders larger (the generator's grads left in D, or a backward lost, move a weight by ~1e-2).
The thread ranks run the real engine; one case runs on 2 gloo processes.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fz3 import launch

pytestmark = pytest.mark.timeout(300)

Z, H, X = 2, 3, 3  # noise, hidden, sample widths
ROWS = 2  # rows per rank per micro-batch


def _net(inp: int, out: int, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    net = nn.Sequential(nn.Linear(inp, H), nn.ReLU(), nn.Linear(H, out))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randint(-2, 3, p.shape, generator=g).float() / 2)
    return net


def _sgd(params):
    return torch.optim.SGD(params, lr=2.0 ** -5, momentum=0.5, weight_decay=2.0 ** -3)


def _rows(seed: int, width: int, world: int) -> torch.Tensor:
    """(world * ROWS, width) small integers; rank r takes rows [r*ROWS, (r+1)*ROWS)."""
    return torch.randint(-2, 3, (world * ROWS, width), generator=torch.Generator().manual_seed(seed)).float()


def _mse(out: torch.Tensor, target: float) -> torch.Tensor:
    return ((out - target) ** 2).sum()


# ---- the GAN: two engines ------------------------------------------------------------------------

ITERS = 3


def _gan_fz3(rank: int, world: int, zero: str) -> list:
    import fz3
    netD, netG = _net(X, 1, 0), _net(Z, X, 1)
    optD, optG = _sgd(netD.parameters()), _sgd(netG.parameters())
    cfg = fz3.Config(param_persistence_threshold=0)
    D, G = fz3.initialize(netD, optD, cfg), fz3.initialize(netG, optG, cfg)
    mine = slice(rank * ROWS, (rank + 1) * ROWS)
    out = []
    for i in range(ITERS):
        real, noise = _rows(10 + i, X, world)[mine], _rows(20 + i, Z, world)[mine]
        {"module": netD, "optimizer": optD, "engine": D}[zero].zero_grad()
        D.backward(_mse(D(real), 1.0))
        fake = G(noise)
        D.backward(_mse(D(fake.detach()), 0.0))
        D.step()
        {"module": netG, "optimizer": optG, "engine": G}[zero].zero_grad()
        G.backward(_mse(D(fake), 1.0))  # through D: D's params get grads the next zero_grad drops
        G.step()
        out.append({**{f"D.{k}": v for k, v in D.full_state_dict().items()},
                    **{f"G.{k}": v for k, v in G.full_state_dict().items()}})
    out.append({"D": D.stats(), "G": G.stats()})
    return out


def _gan_reference(world: int) -> list:
    netD, netG = _net(X, 1, 0), _net(Z, X, 1)
    optD, optG = _sgd(netD.parameters()), _sgd(netG.parameters())
    out = []
    for i in range(ITERS):
        real, noise = _rows(10 + i, X, world), _rows(20 + i, Z, world)
        netD.zero_grad()
        _mse(netD(real), 1.0).backward()
        fake = netG(noise)
        _mse(netD(fake.detach()), 0.0).backward()
        for p in netD.parameters():
            p.grad /= world  # the engines average over ranks (each rank's loss is its rows' sum)
        optD.step()
        netG.zero_grad()
        _mse(netD(fake), 1.0).backward()
        for p in netG.parameters():
            p.grad /= world
        optG.step()
        out.append({**{f"D.{k}": v.clone() for k, v in netD.state_dict().items()},
                    **{f"G.{k}": v.clone() for k, v in netG.state_dict().items()}})
    return out


def _assert_same(got: list, want: list, what: str) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        for k, v in w.items():
            torch.testing.assert_close(g[k], v, rtol=0, atol=1e-6, msg=lambda m: f"{what}, iteration {i}, {k}: {m}")


@pytest.mark.parametrize("zero", ["module", "optimizer", "engine"])
def test_two_engines_train_a_gan_as_plain_pytorch_does(zero):
    """Each engine at parity with plain PyTorch on one process, every iteration; their traces,
    windows and counters are their own."""
    want = _gan_reference(2)
    for out in launch.run_threads(_gan_fz3, 2, args=(zero,)):
        _assert_same(out[:ITERS], want, zero)
        stats = out[ITERS]
        assert stats["D"]["optimizer_steps"] == stats["G"]["optimizer_steps"] == ITERS
        # D runs on inputs with and without grad: a trace for each kind, none dropped
        assert stats["D"]["trace"] == stats["G"]["trace"] == "COMPLETE"
        assert stats["D"]["trace_invalidations"] == stats["G"]["trace_invalidations"] == 0


def test_two_engines_on_gloo_processes():
    want = _gan_reference(2)
    for out in launch.run(_gan_fz3, world_size=2, args=("module",), timeout=180):
        _assert_same(out[:ITERS], want, "gloo")


# ---- several backwards into one engine ------------------------------------------------------------

def _plan(form: str, gas: int) -> list:
    """The loop as a list of ("backward", micro-batch) / ("step",) / ("zero",) actions."""
    if form in ("plain", "coalesce"):  # two backwards, then step(), gas times
        return [a for k in range(gas) for a in (("backward", 2 * k), ("backward", 2 * k + 1), ("step",))]
    if form == "unmanaged":  # managed_gradient_accumulation false: step() after 1, 3, then 2 backwards
        return [("backward", 0), ("step",), ("backward", 1), ("backward", 2), ("backward", 3), ("step",),
                ("backward", 4), ("backward", 5), ("step",)]
    if form == "override":  # set_gradient_accumulation_boundary(False) twice, then True: one window of three
        return [("boundary", False), ("backward", 0), ("step",), ("backward", 1), ("step",), ("boundary", True),
                ("backward", 2), ("step",), ("boundary", None)]
    raise ValueError(form)


def _losses(model, batch: int, rows: slice, world: int):
    x = _rows(100 + batch, X, world)[rows]
    return _mse(model(x), float(batch % 3))


def _several_fz3(rank: int, world: int, form: str, gas: int) -> dict:
    import fz3
    model = _net(X, 1, 0)
    opt = _sgd(model.parameters())
    engine = fz3.initialize(model, opt, fz3.Config(gradient_accumulation_steps=gas, param_persistence_threshold=0,
                                                   managed_gradient_accumulation=form != "unmanaged"))
    mine = slice(rank * ROWS, (rank + 1) * ROWS)
    applied = []
    actions = _plan(form, gas)
    block = engine.coalesce_grad_reduction() if form == "coalesce" else None
    for a in actions:
        if a[0] == "backward":
            if block is not None and a[1] % 2 == 0:
                block.__enter__()
            engine.backward(_losses(engine, a[1], mine, world))
            if block is not None and a[1] % 2 == 1:
                block.__exit__(None, None, None)
                block = engine.coalesce_grad_reduction()
        elif a[0] == "step":
            engine.step()
            applied.append(engine.was_step_applied())
        else:
            engine.set_gradient_accumulation_boundary(a[1])
    return {"state": engine.full_state_dict(), "applied": applied, "steps": engine.global_steps}


def _several_reference(form: str, gas: int, world: int) -> dict:
    """Plain PyTorch: the losses of each window's micro-batches, each / gas (DeepSpeed's scaling,
    which plain PyTorch scripts write by hand), summed into one step."""
    model = _net(X, 1, 0)
    opt = _sgd(model.parameters())
    windows, current = [], []
    boundary = None
    count = 0
    for a in _plan(form, gas):
        if a[0] == "backward":
            current.append(a[1])
        elif a[0] == "step":
            count += 1
            if form == "unmanaged":
                closes = True
            elif boundary is not None:
                closes = boundary
            else:
                closes = count % gas == 0
            if closes:
                windows.append(current)
                current = []
        else:
            boundary = a[1]
    for window in windows:
        opt.zero_grad()
        for b in window:
            (_losses(model, b, slice(None), world) / (world * gas)).backward()
        opt.step()
    return {"state": model.state_dict(), "windows": len(windows)}


@pytest.mark.parametrize("form, gas", [("plain", 1), ("plain", 2), ("coalesce", 1), ("coalesce", 2),
                                       ("unmanaged", 1), ("override", 2)])
def test_several_backwards_add_as_plain_pytorch(form, gas):
    want = _several_reference(form, gas, 2)
    for out in launch.run_threads(_several_fz3, 2, args=(form, gas)):
        assert out["steps"] == want["windows"] and sum(out["applied"]) == want["windows"], out["applied"]
        for k, v in want["state"].items():
            torch.testing.assert_close(out["state"][k], v, rtol=0, atol=1e-6, msg=lambda m: f"{form}, gas {gas}, {k}: {m}")


def _refusals(rank: int, world: int) -> dict:
    import fz3
    model = _net(X, 1, 0)
    engine = fz3.initialize(model, _sgd(model.parameters()), fz3.Config(gradient_accumulation_steps=2))
    mine = slice(rank * ROWS, (rank + 1) * ROWS)
    out = {}
    with engine.coalesce_grad_reduction():
        engine.backward(_losses(engine, 0, mine, world))
        try:
            engine.step()
        except AssertionError as e:
            out["step in block"] = str(e)
        try:
            with engine.coalesce_grad_reduction():
                pass
        except AssertionError as e:
            out["nested"] = str(e)
    engine.step()  # off the boundary: the grads join the window
    engine.backward(_losses(engine, 1, mine, world))
    try:
        model.zero_grad()
    except Exception as e:  # noqa: BLE001
        out["zero_grad"] = f"{type(e).__name__}: {e}"
    engine.step()
    out["applied"] = engine.was_step_applied()
    return out


def test_what_fz3_refuses_says_what_to_do():
    """step() inside coalesce_grad_reduction and a nested block: DeepSpeed's AssertionErrors;
    zero_grad() after a step() inside a window, with newer grads: refused, naming both ways out,
    and the window goes on untouched."""
    for out in launch.run_threads(_refusals, 2):
        assert out["step in block"] == "It is illegal to call Engine.step() inside no_sync context manager"
        assert "cannot be nested" in out["nested"]
        assert out["zero_grad"].startswith("GradError: zero_grad() after 1 backward(s) since a step() inside an "
                                           "accumulation window (micro-step 1 of 2)"), out["zero_grad"]
        assert "right after step()" in out["zero_grad"]
        assert out["applied"]
