"""fz3 with its transformer blocks compiled by inductor (issue #25, bench/diagnostics/compile.py); otherwise
fz3_z3 (same model, AdamW, Config and Options from options["config"]).

options["compile"]:
    "engine"  fz3.initialize, then engine.compile(backend="inductor") (DeepSpeed's name), when the
              engine has that method; else it falls back to "blocks" (`compile_used` says which)
    "blocks"  each model.blocks[i].compile(backend="inductor") in place, then fz3.initialize: fz3
              treats each compiled block as one fetch unit, its hooks out of the graph
              ([Note: compiled regions], fz3/shell/compiled.py)
"""
from __future__ import annotations

import fz3
from fz3.shell.engine import Engine
from systems.common import fz3_settings, make_model, make_optimizer
from systems.fz3_z3 import Fz3

BACKEND = "inductor"


class Fz3Compiled(Fz3):
    def __init__(self, spec: dict) -> None:  # Fz3.__init__ with the compile step put in
        opts = spec.get("options", {})
        self.compile_requested = opts.get("compile", "engine")
        if self.compile_requested not in ("engine", "blocks"):
            raise ValueError(f"options['compile'] must be 'engine' or 'blocks', got {self.compile_requested!r}")
        self.compile_used = "engine" if self.compile_requested == "engine" and hasattr(Engine, "compile") else "blocks"
        self.model = make_model(spec["model"])
        if self.compile_used == "blocks":
            for block in self.model.blocks:
                block.compile(backend=BACKEND)
        self.cfg, options = fz3_settings(opts.get("config", {}))
        self.engine = fz3.initialize(self.model, make_optimizer(self.model.parameters()), self.cfg, options=options)
        if self.compile_used == "engine":
            self.engine.compile(backend=BACKEND)
        self.before: dict = {}
        self.grad_bytes = 0

    def describe(self) -> dict:
        return {"compile_requested": self.compile_requested, "compile_used": self.compile_used,
                "how": "engine.compile(backend='inductor') after fz3.initialize" if self.compile_used == "engine"
                else "block.compile(backend='inductor') for each of model.blocks, before fz3.initialize"}


def build(rank: int, world: int, spec: dict) -> Fz3Compiled:
    return Fz3Compiled(spec)
