"""`module.state_dict()` of a sharded model: whole values inside `gathered_parameters`, an error
outside; never the empty tensors that stand for a param that is not gathered.

    engine.module.state_dict()                          RuntimeError naming the param, and
                                                        engine.full_state_dict() and
                                                        fz3.gathered_parameters
    with fz3.gathered_parameters(engine.module):
        engine.module.state_dict()                      the full values (compute dtype)
        model.save_pretrained(path)                     so Hugging Face's save works here
    engine.module.state_dict(keep_vars=True)            the Parameters themselves, for their
                                                        names and identity (ties), as ever

A param that is not gathered holds an empty tensor (fz3/data/store.py), so a plain state_dict()
returned 0-element tensors for it, even for persistent params right after initialize, and
Hugging Face's save_pretrained wrote them without complaint (from_pretrained failed later).
Each module of an engine gets a state-dict pre-hook that refuses, before the module's own
params are read, when one of them is not AVAILABLE. `keep_vars=True` asks for the variables,
not their values: names and identities, which is what fz3's own readers (full_state_dict,
checkpoints, load_weights) take from it, so it passes. DeepSpeed: a plain state_dict of a
stage-3 model returns its empty partitions silently; its users call
`_zero3_consolidated_16bit_state_dict` or wrap state_dict in `GatheredParameters`.
"""
from __future__ import annotations

from torch import nn

from fz3.core.param.state import AVAILABLE


def install(engine) -> list:
    """A pre-hook on every module of `engine`'s model that owns params, inside leaf modules and
    compiled blocks too. -> the hooks' handles."""
    handles = []
    for module in engine.module.modules():
        own = [(name, engine.param_ids[id(p)]) for name, p in module._parameters.items()
               if p is not None and id(p) in engine.param_ids]
        if own:
            handles.append(module.register_state_dict_pre_hook(_Check(engine, own)))
    return handles


class _Check:
    """state_dict's pre-hook of one module: its own params must be gathered."""

    def __init__(self, engine, own: list[tuple[str, int]]) -> None:
        self.engine, self.own = engine, own

    def __call__(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if keep_vars:
            return
        params = self.engine.params_state
        for name, p in self.own:
            if params.status(p) != AVAILABLE:
                raise RuntimeError(
                    f"fz3: state_dict() of a sharded model: param {prefix + name!r} is not gathered, so "
                    f"this rank holds only its 1/{self.engine.world_size} shard and the tensor is empty. "
                    "Use engine.full_state_dict() (every rank gets the fp32 values, keys as state_dict), "
                    "or call state_dict() (or Hugging Face's save_pretrained) inside "
                    "`with fz3.gathered_parameters(engine.module):`, where the params are whole")
