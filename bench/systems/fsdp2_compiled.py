"""FSDP2 with per-block compile (issue #25, bench/diagnostics/compile.py), torchtitan's recipe: each
transformer block torch.compile(block, backend="inductor", fullgraph=True), put back in
model.blocks, BEFORE fully_shard(block); then fully_shard(model). FSDP2's hooks sit on the
OptimizedModule wrapper, outside the compiled graph. Otherwise as fsdp2.py (CPU mesh, SUM
reduction with FSDP's own division afterwards)."""
from __future__ import annotations

import torch

from systems.common import Plain, make_model
from systems.fsdp2 import shard

BACKEND = "inductor"


class Fsdp2Compiled(Plain):
    def __init__(self, spec: dict, world: int) -> None:
        model = make_model(spec["model"])
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, backend=BACKEND, fullgraph=True)
        shard(model, world)
        super().__init__(model, model)

    def describe(self) -> dict:
        return {"how": "model.blocks[i] = torch.compile(block, backend='inductor', fullgraph=True); "
                       "fully_shard(block) each; fully_shard(model)"}


def build(rank: int, world: int, spec: dict) -> Fsdp2Compiled:
    return Fsdp2Compiled(spec, world)
