"""fz3: ZeRO-3 as pure state transitions (fz3.core) executed by a thin PyTorch shell (fz3.shell).

    import fz3
    cfg = fz3.Config(...)  /  fz3.Config.from_deepspeed(ds_dict)
    with fz3.Init(): model = build()           # optional: built already sharded
    engine = fz3.initialize(model, optimizer, cfg)   # options=fz3.Options(...): fz3's own switches
    loss = f(engine(batch)); engine.backward(loss); engine.step()
    print(fz3.plan(model, cfg, world_size=64, example_inputs=(batch,)))   # before any of it
    with fz3.timeline(engine, "run.json"): ...  # what it did; fz3.DivergenceError if ranks diverge
    assert fz3.check(build).ok                 # this model on N thread ranks against one process

The shell's names load on first use, so `import fz3.core` stays free of torch.
"""
from fz3.config import Config, Options

__all__ = ["Config", "Options", "Init", "initialize", "gathered_parameters", "set_leaf_modules", "load_weights", "plan",
           "timeline", "DivergenceError", "check"]

_LAZY = {"Init": "fz3.build.init", "initialize": "fz3.api", "gathered_parameters": "fz3.io.consolidate",
         "set_leaf_modules": "fz3.shell.tables", "load_weights": "fz3.io.weights",
         "plan": "fz3.observe.plan", "timeline": "fz3.observe.timeline",
         "DivergenceError": "fz3.interpreters.agreement", "check": "fz3.api"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fz3' has no attribute {name!r}")
