"""DeepSpeedCPUAdam (DeepSpeed 0.19.8's cpu_adam op, JIT-built) against torch.optim.AdamW: the same
65,536 params, grads and settings (lr 1e-3, betas 0.9/0.999, eps 1e-8, weight_decay 0.01) for 5
steps; per step the largest absolute and relative difference and the share of elements equal.
Issue #47 point 3: where torch's CPU AdamW would stand in for DeepSpeed's on the host, the
difference is recorded (bench/HISTORY.md):

    DS_ACCELERATOR=cpu bench/.env/bin/python bench/deepspeed_records/cpu_adam_vs_torch.py
"""
import json
import os
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch
out = {"torch": torch.__version__}
try:
    t0 = time.time()
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    torch.manual_seed(0)
    n = 1 << 16
    a = torch.nn.Parameter(torch.randn(n))
    b = torch.nn.Parameter(a.detach().clone())
    kw = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    ds = DeepSpeedCPUAdam([a], adamw_mode=True, **kw)
    th = torch.optim.AdamW([b], **kw)
    out["build_s"] = time.time() - t0
    diffs = []
    for step in range(5):
        g = torch.randn(n)
        a.grad, b.grad = g.clone(), g.clone()
        ds.step()
        th.step()
        d = (a.detach() - b.detach()).abs()
        diffs.append({"max_abs": float(d.max()), "equal_elements": float((d == 0).float().mean()),
                      "max_rel": float((d / b.detach().abs().clamp_min(1e-30)).max())})
    out["steps"] = diffs
except Exception as e:  # record what happens
    out["error"] = f"{type(e).__name__}: {str(e)[:500]}"
print(json.dumps(out, indent=1))
