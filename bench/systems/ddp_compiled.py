"""DDP compiled (issue #25, bench/diagnostics/compile.py): torch.compile(DistributedDataParallel(model),
backend="inductor"), the whole model in one compile, torch._dynamo.config.optimize_ddp left at
its default (True: DDPOptimizer splits the graph at DDP's bucket boundaries so the all-reduce
of a bucket can start while backward goes on). Otherwise as ddp.py (gloo, default 25 MiB
buckets, the C++ reducer)."""
from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from systems.common import Plain, make_model

BACKEND = "inductor"


class DdpCompiled(Plain):
    def __init__(self, spec: dict) -> None:
        model = make_model(spec["model"])
        ddp = DistributedDataParallel(model)
        super().__init__(model, torch.compile(ddp, backend=BACKEND))

    def describe(self) -> dict:
        return {"how": "torch.compile(DistributedDataParallel(model), backend='inductor')",
                "optimize_ddp": torch._dynamo.config.optimize_ddp}


def build(rank: int, world: int, spec: dict) -> DdpCompiled:
    return DdpCompiled(spec)
