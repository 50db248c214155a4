"""bench/systems/launch_count.py, the op counter of bench/launches.py (issue #48): it counts the
ops that reach a kernel, not views or metadata; `.item()` and `torch.equal` as syncs; and not
the optimizer's host-side step counters."""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
from systems.launch_count import LaunchCount  # noqa: E402


def test_kernels_counted_views_left_out_syncs_apart():
    x = torch.ones(4, 3)
    with LaunchCount() as c:
        y = x.view(12)  # a view: no kernel
        z = (y + 1).mul_(2)
        s = z.sum()
        float(s)
        torch.equal(x, x)
    snap = c.snapshot()
    assert snap["launches"] == 3, snap  # add, mul_, sum
    assert snap["syncs"] == {"aten::_local_scalar_dense": 1, "aten::equal": 1} and snap["sync_total"] == 2, snap


def test_the_optimizers_step_counters_are_no_sync():
    """torch keeps `state["step"]` on the host on an accelerator too: its reads are left out."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1, foreach=False)
    p.grad = torch.ones(3)
    opt.step()
    with LaunchCount() as c:
        opt.step()
        p.sum().item()
    snap = c.snapshot()
    assert snap["syncs"] == {"aten::_local_scalar_dense": 1}, snap  # the .item() alone
    assert snap["launches"] > 5, snap
