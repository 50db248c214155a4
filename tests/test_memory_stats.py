"""engine.stats() reports memory by kind (issue #11): shards, gathered params, grads, optimizer
state, buffers, pools, and the device's allocated / peak bytes (RSS on CPU). Checked on 2 gloo
ranks against what the model and optimizer must hold."""
from __future__ import annotations

import pytest
import torch

from fz3 import launch

pytestmark = pytest.mark.timeout(300)

KEYS = {"param_shards", "grad_partitions", "gathered_param_bytes", "peak_gathered_param_bytes",
        "optimizer_state_bytes", "buffer_bytes", "reduce_buffer_bytes", "pool_bytes",
        "device_allocated_bytes", "device_peak_bytes"}


def _stats(rank: int, world_size: int) -> dict:
    import fz3
    from tests.support.parity_models import MODELS, rank_slice

    spec = MODELS["gpt"]
    net = spec.build()
    buffers = sum(b.numel() * b.element_size() for b in net.buffers())
    engine = fz3.initialize(net, torch.optim.AdamW(net.parameters(), lr=1e-3),
                            fz3.Config(param_persistence_threshold=40))
    before = engine.stats()
    loss = spec.loss(engine, rank_slice(spec.batch(0), rank, world_size), 0)
    engine.backward(loss)
    mid = engine.stats()
    engine.step()
    masters = sum(m.numel() for m in engine.store.masters)
    persistent = sum(p.numel for p in engine.spec.params if p.persistent)
    return {"before": before, "mid": mid, "after": engine.stats(), "masters": masters, "buffers": buffers,
            "n_params": len(engine.store.masters), "persistent": persistent}


def test_memory_by_kind():
    for rank, out in enumerate(launch.run(_stats, world_size=2, timeout=240)):
        s, masters = out["after"], out["masters"]
        assert KEYS <= set(s), KEYS - set(s)
        assert s["param_shards"] == out["mid"]["grad_partitions"] == 4 * masters
        assert s["grad_partitions"] == 0  # given back after the optimizer step (FreePartitions)
        # AdamW: exp_avg and exp_avg_sq shaped like the fp32 shard, plus a 0-dim fp32 step each
        assert s["optimizer_state_bytes"] == 2 * 4 * masters + 4 * out["n_params"], (rank, s)
        assert out["before"]["optimizer_state_bytes"] == 0
        assert s["buffer_bytes"] == out["buffers"] > 0
        assert s["gathered_param_bytes"] == 4 * s["live_numel"] == 4 * out["persistent"] > 0
        assert s["peak_gathered_param_bytes"] == 4 * s["peak_live_numel"] > s["gathered_param_bytes"]
        assert s["pool_bytes"] > 0  # CPU: the persistent params' gathered buffers
        assert s["device_peak_bytes"] >= s["device_allocated_bytes"] > 0
