"""Freeing a gathered param frees its memory, even when autograd saved a view of it (issue #11).

[Note: saved views of gathered params] (fz3/shell/saved.py): F.linear saves `w.t()` for its
backward, which kept every Linear's gathered weight alive from forward to backward whatever the
core freed, and the backward's gather made a second copy. On 2 gloo ranks, with nothing kept
between forward and backward (max_reuse_distance 0, no persistent params):

    after the forward, the gathered buffers still in use hold no more than the core's live
    params (stats()["live_numel"]), with and without torch.utils.checkpoint; the training that
    follows matches single-process training (the parity suite checks every model and config).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fz3 import launch

pytestmark = pytest.mark.timeout(240)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _in_use_bytes(engine) -> int:
    """Pooled gather buffers in use; a packed group's staging buffers (GROUP_MOST elements, only
    while a gather is in flight: a prefetch for the backward) are not a param's memory."""
    from fz3.interpreters.messages import GROUP_MOST
    from fz3.data.pool import _users
    return sum(t.numel() * t.element_size() for t in engine.interp.buffers_pool.kept()
               if _users(t) > 0 and t.numel() != GROUP_MOST)


def _run(rank: int, world: int) -> dict:
    import fz3
    torch.manual_seed(0)
    net, ref = Net(), Net()
    ref.load_state_dict(net.state_dict())
    engine = fz3.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1),
                            fz3.Config(max_reuse_distance=0, param_persistence_threshold=0,
                                       prefetch_bucket_size=64 * 64 + 64))
    out = {"in_use": [], "live": []}
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        y = engine(x[rank * 3:(rank + 1) * 3]) if step != 1 else \
            torch.utils.checkpoint.checkpoint(engine, x[rank * 3:(rank + 1) * 3], use_reentrant=False)
        out["in_use"].append(_in_use_bytes(engine))
        out["live"].append(engine.stats()["live_numel"] * 4)
        loss = y.square().mean()
        engine.backward(loss)
        engine.step()
        opt.zero_grad()
        ref_loss = torch.stack([ref(x[r * 3:(r + 1) * 3]).square().mean() for r in range(world)]).mean()
        ref_loss.backward()
        opt.step()
    full = engine.full_state_dict()
    out["max_diff"] = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    return out


def test_freed_params_free_their_memory_after_forward():
    for rank, out in enumerate(launch.run(_run, world_size=2, timeout=200)):
        for step, (in_use, live) in enumerate(zip(out["in_use"], out["live"])):
            assert in_use <= live, f"rank {rank} step {step}: {in_use} bytes of gathered buffers " \
                                   f"in use after the forward, live params {live} bytes"
        assert out["max_diff"] < 1e-6, f"rank {rank}: params differ from one process by {out['max_diff']}"
