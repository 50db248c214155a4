"""fz3: fz3.initialize(model, AdamW, Config and Options from options["config"], fz3_settings); defaults
when empty.
options["init"] True builds the model under fz3.Init() (each param partitioned as its module
is built, DeepSpeed's zero.Init); `construction` then holds ru_maxrss and RSS right after the
Init block, before fz3.initialize (the construction peak proper)."""
from __future__ import annotations

import torch

import fz3
from systems.common import (fz3_settings, loss_fn, make_model, make_optimizer, optimizer_state_tensors,
                            peak_rss_bytes, rss_bytes)


class Fz3:
    def __init__(self, spec: dict) -> None:
        if spec.get("options", {}).get("init"):
            with fz3.Init():
                self.model = make_model(spec["model"])
            self.construction = {"init_peak_rss": peak_rss_bytes(), "init_rss": rss_bytes()}
        else:
            self.model = make_model(spec["model"])
        self.cfg, options = fz3_settings(spec.get("options", {}).get("config", {}))
        opts = spec.get("options", {})
        self.engine = fz3.initialize(self.model, make_optimizer(self.model.parameters(), foreach=opts.get("foreach"),
                                                                fused=opts.get("fused")),
                                     self.cfg, options=options)
        self.before: dict = {}
        self.grad_bytes = 0

    def step(self, x, y) -> float:
        loss = loss_fn(self.engine(x), y)
        self.engine.backward(loss)
        # the grad partitions exist from the window's first reduce to its optimizer step
        # (effects.FreePartitions): count them as the backward left them
        self.grad_bytes = self.engine.store.grad_bytes()
        self.engine.step()
        return loss.item()

    def mark(self) -> None:
        self.before = dict(self.engine.stats())

    def memory(self) -> dict[str, list]:
        e = self.engine
        s = e.store
        grads = torch.empty(self.grad_bytes // 4, device="meta")  # freed by the step: its size
        return {"params": list(s.masters) + list(s.shards) + [p.data for p in s.params],
                "grads": [grads], "optimizer": optimizer_state_tensors(e.optimizer),
                "comm_buffers": [b for bufs in e.interp.pool.values() for b in bufs]}

    def extra(self, steps: int) -> dict:
        now = self.engine.stats()
        per_step = {k: (now[k] - self.before.get(k, 0)) / steps for k in
                    ("all_gather", "all_gather_prefetch", "all_gather_on_demand", "gathered_bytes",
                     "reduce", "reduced_bytes") if k in now}
        return {"stats": dict(now), "per_step": per_step}


def build(rank: int, world: int, spec: dict) -> Fz3:
    return Fz3(spec)
