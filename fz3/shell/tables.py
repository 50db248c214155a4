"""Read the core's static tables off an nn.Module tree.

    params:  every distinct nn.Parameter, in `named_parameters()` order (a tied param once,
             under its first name) -> ParamId
    modules: depth-first pre-order from the root (root = 0), each module object once; the
             descent stops at leaf modules, whose unit is every param of their subtree
             (DeepSpeed: _register_deepspeed_module, z3_leaf_module) -> ModuleId

Leaf modules are marked with `set_leaf_modules(model, [Class, ...])` before `initialize`, as
DeepSpeed's `set_z3_leaf_modules`: a mixture-of-experts block whose experts are chosen by the
data is one fetch unit and one reduction trigger, so every rank runs the same collectives.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Iterable

from torch import nn

from fz3.core.config import Config
from fz3.core.spec import ModelSpec, build_spec

_LEAF_CLASSES: "weakref.WeakKeyDictionary[nn.Module, tuple[type, ...]]" = weakref.WeakKeyDictionary()


def set_leaf_modules(model: nn.Module, classes: Iterable[type]) -> list[nn.Module]:
    """Mark every submodule of `model` that is an instance of one of `classes` as a leaf
    (one fetch unit for its whole subtree). Call before `fz3.initialize`. Returns the modules
    marked; raises if none matched (a typo in a class list is otherwise silent).
    DeepSpeed: deepspeed.utils.set_z3_leaf_modules(model, leaf_module_classes)."""
    classes = tuple(classes)
    for c in classes:
        if not isinstance(c, type) or not issubclass(c, nn.Module):
            raise TypeError(f"set_leaf_modules expects nn.Module subclasses, got {c!r}")
    found = [m for m in model.modules() if isinstance(m, classes)]
    if not found:
        raise ValueError(f"set_leaf_modules: no submodule of {type(model).__name__} is an "
                         f"instance of {[c.__name__ for c in classes]}")
    _LEAF_CLASSES[model] = _LEAF_CLASSES.get(model, ()) + classes
    return found


def leaf_classes(model: nn.Module) -> tuple[type, ...]:
    return _LEAF_CLASSES.get(model, ())


@dataclass
class Tables:
    spec: ModelSpec
    params: list[nn.Parameter]  # by ParamId
    names: list[str]  # by ParamId
    modules: list[nn.Module]  # by ModuleId
    module_names: list[str]


def read_tables(model: nn.Module, *, world_size: int, config: Config) -> Tables:
    """Number the params and fetch units of `model` for the core."""
    params, names, index = [], [], {}
    for name, p in model.named_parameters():  # remove_duplicate: a tied param once
        index[p] = len(params)
        params.append(p)
        names.append(name)
    leaves = leaf_classes(model)
    modules: list[nn.Module] = []
    module_names: list[str] = []
    units: list[tuple[str, list[int], bool]] = []
    seen: set[int] = set()

    def visit(module: nn.Module, name: str) -> None:
        if id(module) in seen:
            return  # a submodule shared under two names is one unit
        seen.add(id(module))
        is_leaf = bool(leaves) and isinstance(module, leaves) and module is not model
        own = module.parameters() if is_leaf else module.parameters(recurse=False)
        modules.append(module)
        module_names.append(name)
        units.append((name, sorted({index[p] for p in own}), is_leaf))
        if not is_leaf:
            for child_name, child in module.named_children():
                visit(child, f"{name}.{child_name}" if name else child_name)

    visit(model, "")
    spec = build_spec([(n, p.numel()) for n, p in zip(names, params)], units,
                      world_size=world_size, persistence_threshold=config.param_persistence_threshold)
    return Tables(spec, params, names, modules, module_names)
