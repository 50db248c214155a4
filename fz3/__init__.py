"""fz3: ZeRO-3 as pure state transitions (fz3.core) executed by a thin PyTorch shell (fz3.shell).

    import fz3
    cfg = fz3.Config(...)  /  fz3.Config.from_deepspeed(ds_dict)
    engine = fz3.initialize(model, optimizer, cfg)
    loss = f(engine(batch)); engine.backward(loss); engine.step()
"""
from fz3.core.config import Config
from fz3.shell.api import initialize
from fz3.shell.consolidate import gathered_parameters
from fz3.shell.tables import set_leaf_modules

__all__ = ["Config", "initialize", "gathered_parameters", "set_leaf_modules"]
