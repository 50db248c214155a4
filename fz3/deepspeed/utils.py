"""deepspeed.utils: the leaf-module marks.

    deepspeed.utils.set_z3_leaf_modules(model, [MixtralSparseMoeBlock])   # fz3.set_leaf_modules
"""
from __future__ import annotations

from torch import nn

from fz3.shell.tables import set_leaf_modules


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes, raise_if_not_found: bool = True) -> list[nn.Module]:
    """Mark every module of `model` that is an instance of one of `leaf_module_classes` (classes,
    or class names bare or module-qualified) as one fetch unit; -> the modules marked. With
    raise_if_not_found, none matching is a ValueError. DeepSpeed: deepspeed.utils.set_z3_leaf_modules."""
    entries = list(leaf_module_classes)
    for e in entries:
        if not isinstance(e, (type, str)):
            raise TypeError(f"set_z3_leaf_modules: leaf_module_classes must be a list of classes or class "
                            f"names, got {e!r}")
    classes = []
    for m in model.modules():
        cls = type(m)
        named = f"{cls.__module__}.{cls.__qualname__}"
        if cls not in classes and any(isinstance(m, e) if isinstance(e, type) else e in (cls.__name__, named)
                                      for e in entries):
            classes.append(cls)
    if not classes:
        if raise_if_not_found:
            raise ValueError(f"set_z3_leaf_modules: no modules of type {entries} found in {type(model).__name__}")
        return []
    return set_leaf_modules(model, classes)
