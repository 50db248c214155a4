"""Read the core's static tables off an nn.Module tree.

    params:  every distinct nn.Parameter, in `named_parameters()` order (a tied param once,
             under its first name) -> ParamId
    modules: depth-first pre-order from the root (root = 0), each module object once; the
             descent stops at leaf modules, whose unit is every param of their subtree
             (DeepSpeed: _register_deepspeed_module, z3_leaf_module) -> ModuleId

Leaf modules are marked with `set_leaf_modules(model_or_submodule, [Class, ...])` before
`initialize` (the module objects themselves are marked), as DeepSpeed's `set_z3_leaf_modules`,
or named by the config (`Config.leaf_module_*`, DeepSpeed's zero_optimization.leaf_module):
a mixture-of-experts block whose experts are chosen by the data is one fetch unit and one
reduction trigger, so every rank runs the same collectives. The config's granularity threshold
(DeepSpeed's stage3_module_granularity_threshold) chooses leaves too, the root among them
([Note: leaf modules by granularity], fz3/core/granularity.py). A module is a leaf if any of
these says so; the config's choices hold for the tables read with that config only (nothing is
marked).
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from fz3.config.config import DEFAULT_LEAF_MODULE_CLASSES, Config
from fz3.core import granularity, stage
from fz3.core.spec import ModelSpec, build_spec
from fz3.shell import compiled, registry

_LEAF_MODULES: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def set_leaf_modules(model: nn.Module, classes: Iterable[type]) -> list[nn.Module]:
    """Mark every module in `model`'s tree (itself included) that is an instance of one of
    `classes` as a leaf: one fetch unit for its whole subtree. `model` may be the root or any
    submodule of what is later passed to `fz3.initialize`; call it before that. Returns the
    modules marked. Raises, naming the classes, if none matched (a typo in a class list would
    otherwise be silent) or if an fz3 engine already manages `model` (the fetch units are fixed
    at initialize). DeepSpeed: deepspeed.utils.set_z3_leaf_modules(model, leaf_module_classes),
    which also marks the modules themselves (`_z3_leaf`)."""
    classes = tuple(classes)
    for c in classes:
        if not isinstance(c, type) or not issubclass(c, nn.Module):
            raise TypeError(f"set_leaf_modules expects nn.Module subclasses, got {c!r}")
    taken = registry.managed(model.parameters())
    if taken is not None:
        raise RuntimeError(f"set_leaf_modules({type(model).__name__}, ...) after fz3.initialize: an "
                           "engine already manages this model and its fetch units are fixed; call "
                           "set_leaf_modules before fz3.initialize")
    found = [m for m in model.modules() if isinstance(m, classes)]
    if not found:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(f"set_leaf_modules: no module of {type(model).__name__} is an instance of "
                         f"{[c.__name__ for c in classes]}; its module classes are {present}")
    mark_leaves(found)
    return found


def mark_leaves(modules: Iterable[nn.Module]) -> None:
    """Make each of `modules` a leaf (what set_leaf_modules and the leaf_module config do)."""
    for m in modules:
        _LEAF_MODULES.add(m)


def marked_leaf(module: nn.Module) -> bool:
    return module in _LEAF_MODULES


def config_leaves(model: nn.Module, config: Config) -> list[nn.Module]:
    """The modules of `model` that the config's leaf_module_* fields name, in named_modules()
    order: a class name (bare `type(m).__name__` or `module.qualname`), a module name as
    named_modules() gives it, or a suffix of one. Raises ValueError, naming the entry and what
    the model has, for an entry that matches nothing, except DeepSpeed's default classes (HF
    MoE blocks most models lack). DeepSpeed: apply_zero_leaf_module_config (which only warns).
    """
    named = list(model.named_modules())
    by_class = {m: (type(m).__name__, f"{type(m).__module__}.{type(m).__qualname__}") for _, m in named}
    rules = [("classes", lambda e, n, m: e in by_class[m]),  # DeepSpeed's sub-key, match
             ("names", lambda e, n, m: n == e),
             ("name_suffixes", lambda e, n, m: n.endswith(e))]
    found: dict[int, nn.Module] = {}
    for sub, match in rules:
        for entry in getattr(config, f"leaf_module_{sub}"):
            hits = [m for n, m in named if match(entry, n, m)]
            if not hits and not (sub == "classes" and entry in DEFAULT_LEAF_MODULE_CLASSES):
                raise ValueError(f"Config.leaf_module_{sub} (zero_optimization.leaf_module.{sub}) "
                                 f"entry {entry!r} matches no module of {type(model).__name__}; "
                                 f"it has {_what_it_has(sub, named)}")
            found.update((id(m), m) for m in hits)
    return [m for _, m in named if id(m) in found]


def granular(model: nn.Module, numel=None) -> tuple[list[granularity.Node], list[nn.Module]]:
    """The module tree as fz3/core/granularity.py reads it: one node per module object, the root
    first, each with its class name, whether torch counts it a container (by class name, as
    DeepSpeed asks), its own and its subtree's param numel, and its children's nodes. `numel`:
    a param's full numel, where the params no longer show it (sharded)."""
    numel = numel or torch.Tensor.numel
    modules, index = [], {}
    for m in model.modules():  # each object once
        index[id(m)] = len(modules)
        modules.append(m)
    containers = set(torch.nn.modules.container.__all__)
    tree = [granularity.Node(type(m).__name__, type(m).__name__ in containers,
                             sum(map(numel, m.parameters(recurse=False))),
                             sum(map(numel, m.parameters())), next(m.parameters(), None) is not None,
                             tuple(index[id(c)] for c in m.children()))
            for m in modules]
    return tree, modules


def granular_leaves(model: nn.Module, threshold: int, numel=None) -> list[nn.Module]:
    """The modules stage3_module_granularity_threshold makes leaves ([Note: leaf modules by
    granularity], fz3/core/granularity.py); the log names the smallest granularity when the
    threshold is below it, as DeepSpeed's does."""
    if threshold <= 0:
        return []
    tree, modules = granular(model, numel)
    choice = granularity.leaves(tree, threshold)
    if not choice.leaves:
        logging.getLogger("fz3").warning(
            "fz3: stage3_module_granularity_threshold=%d makes no module a leaf: the smallest module granularity "
            "is %s's, %s. To make the threshold effective, set it >= %s", threshold, choice.smallest_class,
            choice.smallest, choice.smallest)
    return [modules[i] for i in choice.leaves]


def _what_it_has(sub: str, named: list[tuple[str, nn.Module]]) -> str:
    if sub == "classes":
        return f"module classes {sorted({type(m).__name__ for _, m in named})}"
    names = [n for n, _ in named if n]
    shown = ", ".join(repr(n) for n in names[:30])
    more = f", ... ({len(names)} in all)" if len(names) > 30 else ""
    return f"modules named [{shown}{more}]"


@dataclass
class Tables:
    spec: ModelSpec
    params: list[nn.Parameter]  # by ParamId
    names: list[str]  # by ParamId
    modules: list[nn.Module]  # by ModuleId
    module_names: list[str]
    compiled: tuple[int, ...] = ()  # ModuleIds of the compiled regions (each a leaf)


def read_tables(model: nn.Module, *, world_size: int, config: Config, numels: list[int] | None = None) -> Tables:
    """Number the params and fetch units of `model` for the core. `numels`: each param's size,
    where the params no longer show it (sharded: engine.compile() reads the units again)."""
    params, names, index = [], [], {}
    for name, p in model.named_parameters():  # remove_duplicate: a tied param once
        index[p] = len(params)
        params.append(p)
        names.append(name)
    modules: list[nn.Module] = []
    module_names: list[str] = []
    units: list[tuple[str, list[int], bool]] = []
    seen: set[int] = set()
    leaves = {id(m) for m in config_leaves(model, config)}
    sizes = [p.numel() for p in params] if numels is None else numels
    by_granularity = {id(m) for m in granular_leaves(model, config.module_granularity_threshold,
                                                     lambda p: sizes[index[p]])}

    compiled_units: list[int] = []

    def visit(module: nn.Module, name: str, wrapped: bool = False) -> None:
        if id(module) in seen:
            return  # a submodule shared under two names is one unit
        seen.add(id(module))
        # [Note: compiled regions]: a module compiled in place, or the one a torch.compile
        # wrapper (not the root) holds, is a leaf
        region = module is not model and (wrapped or compiled.compiled_in_place(module))
        # (the root only by granularity, as DeepSpeed's walk may choose it: the whole model one unit)
        leaf = (module is not model and (marked_leaf(module) or id(module) in leaves or region)) \
            or id(module) in by_granularity
        own = module.parameters() if leaf else module.parameters(recurse=False)
        if region:
            compiled_units.append(len(modules))
        modules.append(module)
        module_names.append(name)
        units.append((name, sorted({index[p] for p in own}), leaf))
        if not leaf:
            wraps = module is not model and compiled.is_wrapper(module)
            for child_name, child in module.named_children():
                visit(child, f"{name}.{child_name}" if name else child_name, wraps)

    visit(model, "")
    threshold, model_threshold = stage.persistence(config)  # every param at stages 0-2
    shard_world = stage.layout_world(config, world_size)  # 1 at stage 0: whole on every rank
    spec = build_spec(list(zip(names, sizes)), units, world_size=shard_world, persistence_threshold=threshold,
                      model_persistence_threshold=model_threshold, replicas=world_size // shard_world,
                      max_inflight=config.max_ongoing_fetch_events,
                      secondary=stage.secondary_world(config, world_size))
    return Tables(spec, params, names, modules, module_names, tuple(compiled_units))
