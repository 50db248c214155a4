"""How often a steady fz3 step makes the host wait for its device (issue #48 point 1), counted on
CPU. On an accelerator `.item()`, `float(t)`, `bool(t)`, `torch.equal` and `.tolist()` of a
device tensor each stop the host until the device has caught up, so the host can no longer run
ahead. A CPU run has no device, so the count is made the way an accelerator would see it: a
dispatch mode counts every such read (and `Tensor.tolist` is wrapped, as a CPU tensor's makes no
ATen op), less the reads of data that is host memory on an accelerator too:

- torch.optim's step counters (`_get_value`: on the CPU unless capturable or fused);
- the divergence check's descriptors (fz3/interpreters/agreement.py `_resolve`: host tensors,
  over a gloo side group on NCCL and HCCL; they make the host wait for its peers, not its device);
- the grad norm's ride in the descriptor exchange (`Agreement.all_reduce_sum` takes a CPU
  float64 only: on an accelerator the norm is all-reduced on the device, dist.py);
- the last step's verdict, read at the next boundary (fz3/shell/verdict.py `read`: on an
  accelerator a copy in pinned host memory, waited for by its own event, queued a whole step
  before: [Note: the verdict on the device], fz3/core/grad/verdict.py).

With an optimizer that takes the verdict as a tensor (torch's fused=True AdamW here) a steady
step reads nothing, fp16's dynamic loss scale included (kept on the device:
fz3/shell/device_scale.py; its move read a step late, `scale_read`). With one that cannot (torch's foreach and for-loop implementations refuse
`found_inf`), the boundary reads it: one read, `finite(norm)` (fz3/interpreters/dist.py), which
fz3 names once at initialize on an accelerator. The teeth: one `.item()` or `.tolist()` added to
the clipping is seen and named."""
from __future__ import annotations

import os
import threading
import traceback

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fz3
from fz3 import launch

READS = {"aten::_local_scalar_dense", "aten::equal", "aten::is_nonzero"}
HOST = {(os.path.join("torch", "optim", "optimizer.py"), "_get_value"),
        (os.path.join("fz3", "interpreters", "agreement.py"), "_resolve"),
        (os.path.join("fz3", "interpreters", "agreement.py"), "all_reduce_sum"),
        (os.path.join("fz3", "shell", "verdict.py"), "read"),
        (os.path.join("fz3", "shell", "verdict.py"), "scale_read")}


def _where() -> str | None:
    """The fz3 (or test) frame a read comes from; None when it is a read of host data (HOST)."""
    stack = traceback.extract_stack()[:-2]
    if any(f.filename.endswith(path) and f.name == name for f in stack for path, name in HOST):
        return None
    ours = [f for f in stack if os.sep + "fz3" + os.sep in f.filename and "site-packages" not in f.filename]
    f = ours[-1] if ours else stack[-1]
    return f"{os.path.basename(f.filename)}:{f.name}"


class DeviceReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in READS and (where := _where()) is not None:
            self.seen.append(where)
        return func(*args, **(kwargs or {}))


class _Counting:
    """`Tensor.tolist` counted into the reads of this thread's DeviceReads (one per rank)."""

    def __init__(self) -> None:
        self.modes: dict[int, DeviceReads] = {}
        self.original = torch.Tensor.tolist

    def __enter__(self):
        counting = self

        def tolist(t):
            mode = counting.modes.get(threading.get_ident())
            if mode is not None and (where := _where()) is not None:
                mode.seen.append(where + " (tolist)")
            return counting.original(t)

        torch.Tensor.tolist = tolist
        return self

    def __exit__(self, *exc) -> None:
        torch.Tensor.tolist = self.original


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))


def _steady_step(rank: int, world: int, config: fz3.Config, counting: _Counting, fused: bool = True,
                 scheduler: bool = False) -> list[str]:
    model = _net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused or None)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.9 ** s) if scheduler else None
    engine = fz3.initialize(model, optimizer, config, lr_scheduler=sched)
    g = torch.Generator().manual_seed(rank)
    data = [torch.randn(8, 16, generator=g) for _ in range(4 * config.gradient_accumulation_steps)]
    for x in data[:-config.gradient_accumulation_steps]:  # warm up: the trace recorded, then replayed
        engine.backward(engine(x).square().mean())
        engine.step()
    with DeviceReads() as mode:
        counting.modes[threading.get_ident()] = mode
        for x in data[-config.gradient_accumulation_steps:]:
            loss = engine(x).square().mean()
            engine.backward(loss)
            engine.step()
        del counting.modes[threading.get_ident()]
    return mode.seen


CONFIGS = {
    "default": fz3.Config(),
    "all sharded, clipped": fz3.Config(param_persistence_threshold=0, gradient_clipping=1.0),
    "bf16, accumulation": fz3.Config(compute_dtype="bf16", gradient_accumulation_steps=2,
                                     param_persistence_threshold=0),
    "fp16, dynamic loss scale": fz3.Config(compute_dtype="fp16", param_persistence_threshold=0,
                                           loss_scale_window=2),  # it grows in the counted step
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_steady_step_never_reads_the_device(name):
    with _Counting() as counting:
        seen = launch.run_threads(_steady_step, 2, args=(CONFIGS[name], counting, True, name == "default"))
    for reads in seen:
        assert reads == [], reads


def test_an_optimizer_that_cannot_take_the_verdict_reads_it_once():
    with _Counting() as counting:
        seen = launch.run_threads(_steady_step, 2, args=(CONFIGS["all sharded, clipped"], counting, False))
    for reads in seen:
        assert reads == ["dist.py:finite"], reads


@pytest.mark.parametrize("read, named", [(lambda t: float(t), "engine.py:_step_optimizer"),
                                         (lambda t: t.reshape(1).tolist(), "engine.py:_step_optimizer (tolist)")])
def test_the_count_sees_a_read_added(monkeypatch, read, named):
    """Teeth: one `.item()` (or `.tolist()`) added to the clipping is one more read, named by the
    fz3 frame that called it."""
    from fz3.shell import engine, optim
    original = optim.clip_grad_norm

    def clip_reading_the_norm(store, max_norm, norm):
        read(norm)
        original(store, max_norm, norm)

    monkeypatch.setattr(engine, "clip_grad_norm", clip_reading_the_norm)
    with _Counting() as counting:
        seen = launch.run_threads(_steady_step, 2, args=(CONFIGS["all sharded, clipped"], counting))
    assert seen[0] == [named], seen[0]
