"""fz3 eager with each transformer block one fetch unit (fz3.set_leaf_modules on the Block class),
the units fz3-compiled has; otherwise fz3_z3. bench/diagnostics/compile.py runs it beside fz3 eager (every
module its own unit) and fz3 compiled, to say how much of the compiled speed-up is the coarser
units (fewer, larger gathers and reduces) and how much the compiler."""
from __future__ import annotations

import fz3
from gpt import Block
from systems.common import fz3_settings, make_model, make_optimizer
from systems.fz3_z3 import Fz3


class Fz3Blocks(Fz3):
    def __init__(self, spec: dict) -> None:
        self.model = make_model(spec["model"])
        fz3.set_leaf_modules(self.model, [Block])
        self.cfg, options = fz3_settings(spec.get("options", {}).get("config", {}))
        self.engine = fz3.initialize(self.model, make_optimizer(self.model.parameters()), self.cfg, options=options)
        self.before: dict = {}
        self.grad_bytes = 0

    def describe(self) -> dict:
        return {"how": "fz3.set_leaf_modules(model, [Block]) before fz3.initialize: a block per fetch unit, eager"}


def build(rank: int, world: int, spec: dict) -> Fz3Blocks:
    return Fz3Blocks(spec)
