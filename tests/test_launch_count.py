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


def test_the_grad_norm_squares_and_sums_its_segments_at_once():
    """fz3's grad norm launches one norm per segment (two with a tail) and four ops for all of
    them together, not four a segment (fz3/shell/optim.py [Note: norm in rows]); its value is the
    fp64 norm's."""
    from types import SimpleNamespace

    from fz3.shell.optim import ROW, global_grad_norm
    torch.manual_seed(0)
    segments = [torch.randn(ROW * 2 + 5) for _ in range(12)]
    store = SimpleNamespace(segment_grads=lambda: segments, device=torch.device("cpu"))
    with LaunchCount() as c:
        norm = global_grad_norm(store, lambda t: t)
    launches = c.snapshot()["launches"]
    assert launches <= 2 * len(segments) + 8, c.snapshot()
    exact = torch.cat(segments).double().norm().float()
    assert torch.allclose(norm, exact, rtol=1e-6), (norm, exact)
