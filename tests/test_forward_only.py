"""Forward-only passes between training steps (issue #10): each pass kind keeps its own trace.

Training passes fetch every module in forward and in backward; an evaluation under no_grad
fetches them in forward only. With one trace every switch departed from the plan and prefetch
was lost on every alternation (DeepSpeed #5662). Here, on 2 gloo ranks: after a warm-up,
10 alternations of a training step and an evaluation (model.eval() + no_grad, or
inference_mode) keep `trace_invalidations` constant and prefetch in both kinds of pass, and no
inference tensor is left in the buffer pool or in any stored tensor. That the numbers do not
change is the parity suite's job (tests/support/parity.py runs forward-only passes in every model).
"""
from __future__ import annotations

import pytest
import torch

from fz3 import launch

pytestmark = pytest.mark.timeout(300)


def _inference_tensors(engine) -> list[str]:
    """Where an inference tensor sits in what outlives a pass: pool, params, shards, grads."""
    found = [f"pool {(t.numel(), t.dtype)}" for t in engine.interp.buffers_pool.kept() if t.is_inference()]
    found += [f"param {n}" for n, p in zip(engine.tables.names, engine.tables.params) if p.data.is_inference()]
    found += [f"master {i}" for i, m in enumerate(engine.store.masters) if m.is_inference()]
    found += [f"shard {i}" for i, s in enumerate(engine.store.shards) if s.is_inference()]
    return found + [f"grads of segment {i}" for i, seg in enumerate(engine.store.segments) if seg.grads.is_inference()]


def _alternate(rank: int, world_size: int) -> dict:
    import fz3
    from tests.support.parity_models import MODELS, rank_slice

    spec = MODELS["gpt"]
    torch.manual_seed(0)
    net = spec.build()
    engine = fz3.initialize(net, torch.optim.AdamW(net.parameters(), lr=1e-3),
                            fz3.Config(param_persistence_threshold=0, prefetch_bucket_size=200))

    def train(i: int) -> None:
        loss = spec.loss(engine, rank_slice(spec.batch(i), rank, world_size), i)
        engine.backward(loss)
        engine.step()

    def evaluate(i: int, inference: bool) -> None:
        net.eval()
        with torch.inference_mode() if inference else torch.no_grad():
            spec.loss(engine, rank_slice(spec.batch(i), rank, world_size), i)
        net.train()

    out = {"prefetch": [], "inference_tensors": []}
    with torch.inference_mode():  # an evaluation before the first step
        spec.loss(engine, rank_slice(spec.batch(0), rank, world_size), 0)
    for i in range(3):  # warm-up: each kind records, then completes
        train(i)
        evaluate(i, inference=False)
    out["before"] = engine.stats()["trace_invalidations"]
    for i in range(3, 13):
        for kind in ("train", "eval"):
            before = engine.stats()["all_gather_prefetch"]
            train(i) if kind == "train" else evaluate(i, inference=i % 2 == 0)
            out["prefetch"].append((kind, engine.stats()["all_gather_prefetch"] - before))
            out["inference_tensors"] += _inference_tensors(engine)
    out["after"] = engine.stats()["trace_invalidations"]
    out["trace"] = engine.stats()["trace"]
    return out


def test_alternating_train_and_eval_keeps_both_traces():
    for rank, out in enumerate(launch.run(_alternate, world_size=2, timeout=240)):
        assert out["after"] == out["before"], f"rank {rank}: the trace was invalidated {out}"
        assert all(n > 0 for _, n in out["prefetch"]), f"rank {rank}: a pass without prefetch {out['prefetch']}"
        assert {k for k, _ in out["prefetch"]} == {"train", "eval"}
        assert out["trace"] == "COMPLETE"
        assert not out["inference_tensors"], f"rank {rank}: {out['inference_tensors'][:5]}"
