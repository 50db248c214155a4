"""No data parallelism at all: each rank steps its own copy of the model on its local batch, no
communication (bench/diagnostics/compile.py). What a compiler can buy the compute itself on this machine,
with no wrapper around it: options["compile"]
    None     eager
    "blocks" each model.blocks[i].compile(backend="inductor"): the units fz3-compiled and
             FSDP2-compiled compile
    "model"  model.compile(backend="inductor"): the whole forward in one graph, as DDP compiled
Its speed-up bounds what compiling can give a sharded system at the same units: the rest of
their step (gathers, reduces, hooks) is not compiled by any of them."""
from __future__ import annotations

from systems.common import Plain, make_model

BACKEND = "inductor"
COMPILE = (None, "blocks", "model")


class Local(Plain):
    def __init__(self, spec: dict) -> None:
        self.how = spec.get("options", {}).get("compile")
        if self.how not in COMPILE:
            raise ValueError(f"options['compile'] must be one of {COMPILE}, got {self.how!r}")
        model = make_model(spec["model"])
        if self.how == "blocks":
            for block in model.blocks:
                block.compile(backend=BACKEND)
        elif self.how == "model":
            model.compile(backend=BACKEND)
        super().__init__(model, model)

    def describe(self) -> dict:
        return {"how": {None: "the plain model, eager, no communication",
                        "blocks": "block.compile(backend='inductor') for each of model.blocks, no communication",
                        "model": "model.compile(backend='inductor'), no communication"}[self.how]}


def build(rank: int, world: int, spec: dict) -> Local:
    return Local(spec)
