"""Buffers agree across ranks (fz3/shell/buffers.py): rank 0's are broadcast before each forward
pass, before full_state_dict() and before a checkpoint save, as DDP's broadcast_buffers=True.

A model with BatchNorm, each rank on its own data: DDP and fz3 train side by side on 2 gloo
ranks and end with the same running statistics; on thread ranks an eval pass gives every rank
the same outputs, full_state_dict() and a checkpoint hold rank 0's buffers on every rank, and
with Options(broadcast_buffers=False) every rank keeps its own.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fz3 import launch

pytestmark = pytest.mark.timeout(300)

STEPS = 3


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 4), nn.ReLU(), nn.BatchNorm1d(4), nn.Linear(4, 1))


def batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(6, 4, generator=g) * (1 + rank)  # each rank its own statistics


BUFFERS = ("0.running_mean", "0.running_var", "0.num_batches_tracked", "3.running_mean", "3.running_var")


def _with_ddp(rank: int, world: int) -> dict:
    import fz3
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp_model = build()
    ddp = DDP(ddp_model)  # broadcast_buffers=True: DDP's default
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    model = build()
    engine = fz3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), fz3.Config())
    for step in range(STEPS):
        x = batch(step, rank)
        ddp_opt.zero_grad()
        ddp(x).sum().backward()
        ddp_opt.step()
        engine.backward(engine(x).sum())
        engine.step()
    ddp_state = {k: v.clone() for k, v in ddp_model.state_dict().items()}
    return {"ddp": ddp_state, "fz3": engine.full_state_dict()}


def test_running_statistics_are_ddps_after_training():
    outs = launch.run(_with_ddp, world_size=2, timeout=120)
    ddp0 = outs[0]["ddp"]  # DDP's rank 0: its buffers are the ones DDP broadcasts
    for r, out in enumerate(outs):
        for k in BUFFERS:
            assert torch.allclose(out["fz3"][k].double(), ddp0[k].double(), rtol=1e-5, atol=1e-6), (r, k)
        assert torch.equal(out["fz3"]["0.running_mean"], ddp0["0.running_mean"]), r  # inputs only: exact
        for k in ("1.weight", "4.bias"):
            assert torch.allclose(out["fz3"][k], ddp0[k], rtol=1e-5, atol=1e-6), (r, k)


def _threads(rank: int, world: int, broadcast: bool, ckpt: str | None) -> dict:
    import fz3
    model = build()
    engine = fz3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), fz3.Config(),
                            options=fz3.Options(broadcast_buffers=broadcast))
    for step in range(STEPS):
        engine.backward(engine(batch(step, rank)).sum())
        engine.step()
    own = {k: v.clone() for k, v in model.named_buffers()}  # after this rank's last forward
    model.eval()
    with torch.no_grad():
        evaluated = engine(batch(99, 0))  # the same input on every rank
    full = engine.full_state_dict()
    if ckpt is not None:
        engine.save_checkpoint(ckpt, tag="t")
    return {"own": own, "eval": evaluated, "full": full}


@pytest.mark.parametrize("world", [2, 3])
def test_eval_passes_and_full_state_dict_see_rank_0s_buffers_on_every_rank(world):
    outs = launch.run_threads(_threads, world, args=(True, None))
    assert not torch.equal(outs[0]["own"]["0.running_mean"], outs[1]["own"]["0.running_mean"])  # drifts in a forward
    for out in outs[1:]:
        assert torch.equal(out["eval"], outs[0]["eval"])
        for k in BUFFERS:
            assert torch.equal(out["full"][k], outs[0]["full"][k]), k


def test_without_the_broadcast_every_rank_keeps_its_own(caplog):
    import logging
    with caplog.at_level(logging.WARNING, logger="fz3"):
        outs = launch.run_threads(_threads, 2, args=(False, None))
    said = sorted(r.getMessage() for r in caplog.records if "own buffers" in r.getMessage())
    assert len(said) == 2 and all(f"rank {r}: full_state_dict() returns this rank's own buffers" in m
                                  for r, m in enumerate(said)), said
    assert not torch.equal(outs[0]["eval"], outs[1]["eval"])
    for out in outs:
        for k in BUFFERS:
            assert torch.equal(out["full"][k], out["own"][k]), k  # full_state_dict: this rank's own
    assert not torch.equal(outs[0]["full"]["0.running_mean"], outs[1]["full"]["0.running_mean"])


def test_a_checkpoint_keeps_the_buffers_every_rank_has(tmp_path):
    from fz3.consolidate import fp32_state_dict
    outs = launch.run_threads(_threads, 2, args=(True, str(tmp_path)))
    saved, _ = fp32_state_dict(str(tmp_path), "t")
    for k in BUFFERS:
        for out in outs:
            assert torch.equal(saved[k], out["full"][k]), k


def test_the_option_is_a_bool():
    import fz3
    with pytest.raises(TypeError, match="broadcast_buffers must be a bool, got 'yes'"):
        fz3.Options(broadcast_buffers="yes")


class Odd(nn.Module):
    """Buffers of several dtypes and sizes in one broadcast: 3 bf16 (6 bytes, so the next starts
    unaligned), a 0-d int64, bools, a non-contiguous float32 view, and one registered twice."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.register_buffer("bf16", torch.full((3,), 1.5 + rank, dtype=torch.bfloat16))
        self.register_buffer("count", torch.tensor(7 + rank))
        self.register_buffer("mask", torch.tensor([True, False, bool(rank)]))
        self.register_buffer("strided", (torch.arange(12.0) + rank).reshape(3, 4).t())
        self.register_buffer("again", self.count)

    def forward(self, x):
        return self.lin(x)


def _odd(rank: int, world: int) -> dict:
    import fz3
    model = Odd(rank)
    engine = fz3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), fz3.Config())
    for b in model.buffers() if rank else ():  # initialize starts every rank from rank 0's values
        b.logical_not_() if b.dtype == torch.bool else b.add_(rank)  # ... then the others drift
    engine(torch.ones(1, 2))
    return {k: v.clone() for k, v in model.named_buffers()}


def test_buffers_of_every_dtype_and_layout_arrive_whole():
    outs = launch.run_threads(_odd, 3)
    want = Odd(0)
    for out in outs:
        for k, v in want.named_buffers():
            assert out[k].dtype == v.dtype and torch.equal(out[k], v), (k, out[k], v)
