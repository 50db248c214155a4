"""Which live engine manages a parameter: `register(engine)` at initialize, `engine_of(param)`.

Used by `gathered_parameters` (which engine gathers a param), by `fz3.initialize` (a model whose
params an engine already manages cannot get a second one: its params hold empty .data and the
new engine would shard nothing) and by `set_leaf_modules` (too late once an engine exists).

[Note: no WeakKeyDictionary of tensors] A WeakKeyDictionary compares its keys with ==, and a
Tensor's == is elementwise: looking up a Parameter raised "Boolean value of Tensor with no
values is ambiguous" (a sharded param's .data is empty). So: keyed by id(param), each entry
holding a weak reference to the param (checked with `is`, and whose callback drops the entry
when the param dies, before its id can be reused) and one to the engine.
"""
from __future__ import annotations

import weakref
from typing import Iterable, Optional

from torch import nn

_ENGINES: dict[int, tuple["weakref.ref[nn.Parameter]", "weakref.ref[object]"]] = {}


def register(engine) -> None:
    eng = weakref.ref(engine)
    for p in engine.tables.params:
        key = id(p)
        _ENGINES[key] = (weakref.ref(p, lambda _, key=key: _ENGINES.pop(key, None)), eng)


def engine_of(param: nn.Parameter):
    """The live engine that manages `param`, or None."""
    entry = _ENGINES.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1]()


def managed(params: Iterable[nn.Parameter]) -> Optional[nn.Parameter]:
    """The first of `params` a live engine manages, or None."""
    for p in params:
        if engine_of(p) is not None:
            return p
    return None
