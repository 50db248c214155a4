"""fp16 training on the engine: fp16 compute params and buffers over fp32 masters, the loss
scaled in engine.backward (or engine.scale for a backward of one's own), an overflow on one rank
skipping the step on every rank, and the loss scale saved and restored with the checkpoint.
What DeepSpeed does with the same script is tests/test_loss_scale.py's."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fz3 import launch

pytestmark = pytest.mark.timeout(300)

CFG = dict(compute_dtype="fp16", gradient_accumulation_steps=2, loss_scale_window=2, initial_scale_power=18,
           param_persistence_threshold=0)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 2)
        self.register_buffer("shift", torch.full((8,), 0.25))

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x) + self.shift))


def _batch(i: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * i + rank))


def _train(engine, rank: int, first: int, steps: int, poison: dict | None = None) -> list:
    rows = []
    for i in range(first, first + steps):
        loss = engine(_batch(i, rank)).float().pow(2).mean()
        if rank in (poison or {}).get(i, ()):
            loss = loss * float("inf")
        engine.backward(loss)
        engine.step()
        rows.append((loss.item(), engine.optimizer.loss_scale, engine.optimizer.overflow, engine.was_step_applied(),
                     engine.skipped_steps))
    return rows


def _run(rank: int, world: int, tmp: str) -> dict:
    import fz3
    torch.manual_seed(0)
    model = Net()
    engine = fz3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), fz3.Config(**CFG))
    out = {"dtypes": sorted({str(p.dtype) for p in model.parameters()} | {str(model.shift.dtype)}),
           "masters": sorted({str(m.dtype) for m in engine.store.masters})}
    out["first"] = _train(engine, rank, 0, 8, poison={5: (1,)})  # rank 1's loss overflows at micro-step 5
    engine.save_checkpoint(tmp, tag="mid")
    out["saved_scale"] = tuple(engine.loss_scale)
    out["after"] = _train(engine, rank, 8, 6)
    torch.manual_seed(0)
    fresh_model = Net()
    fresh = fz3.initialize(fresh_model, torch.optim.AdamW(fresh_model.parameters(), lr=1e-2), fz3.Config(**CFG))
    fresh.load_checkpoint(tmp, tag="mid")
    out["loaded_scale"] = tuple(fresh.loss_scale)
    out["resumed"] = _train(fresh, rank, 8, 6)
    # engine.scale(loss).backward() is engine.backward(loss)
    x = _batch(99, rank)
    out["scaled"] = (fresh.scale(fresh(x).float().pow(2).mean()).item(),
                     fresh(x).float().pow(2).mean().item() / 2 * fresh.loss_scale.scale)
    return out


def test_fp16_trains_skips_everywhere_and_resumes_its_scale(tmp_path):
    outs = launch.run_threads(_run, 2, args=(str(tmp_path / "ckpt"),))
    for rank, out in enumerate(outs):
        assert out["dtypes"] == ["torch.float16"] and out["masters"] == ["torch.float32"]
        first = out["first"]
        scales = [r[1] for r in first]
        assert scales[0] == 2.0 ** 18 and min(scales) < 2.0 ** 18, scales  # the first steps overflow
        assert first[5][3] is False and first[5][2] is True, first[5]  # rank 1's inf: skipped on every rank
        assert [r[3] for r in first] == [r[3] for r in outs[0]["first"]]
        assert out["loaded_scale"] == out["saved_scale"]
        assert out["resumed"] == out["after"], rank  # the scale, the skips and the losses, bit for bit
        assert any(r[1] > out["saved_scale"][0] for r in out["after"]), "the scale grows after the load"
        assert out["scaled"][0] == pytest.approx(out["scaled"][1], rel=1e-3)
