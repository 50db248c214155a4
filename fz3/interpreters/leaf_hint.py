"""Which leaf module would make ranks that diverged agree: the hint a DivergenceError ends with.

    ranks' collectives' modules      their parent                  hint
    moe.experts.0 (rank 0)     ->    'moe.experts' (ModuleList,    'moe' (MoE):
    moe.experts.1 (rank 1)           never called) -> 'moe'        fz3.set_leaf_modules(model, [MoE])
    c (rank 0), extra (rank 1) ->    the model itself              none (a leaf model: all gathered)

A block that picks its submodules from the data (an MoE whose experts run only when routed to)
diverges by design under ZeRO-3: each rank gathers the experts it routes to. Marked a leaf, it
is one fetch unit and one reduction trigger, the same on every rank (fz3/shell/tables.py). The
divergence check (agreement.py) calls `Agreement.hint` with each rank's descriptor; the engine
sets it from the model's tables, which the interpreter never sees.
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch


def leaf_hint(names: Sequence[str],
              modules: Sequence[tuple[str, type]]) -> Callable[[Mapping[int, Sequence[int]]], str]:
    """`Agreement.hint` for a model: when the ranks' differing collectives concern params of
    different modules under one parent other than the model itself, a sentence naming that
    parent as the leaf module to mark, else ''. A block that picks its submodules from the data
    (an MoE whose experts run only when routed to) diverges by design; as a leaf it is one fetch
    unit that every rank gathers and reduces whole, whichever submodules run. `names`: the
    params' names by ParamId; `modules`: (path, class) of every module. The parent named is the
    nearest that is called: a container (ModuleList, ModuleDict) never is, so is never a unit.
    DeepSpeed: set_z3_leaf_modules, which its users must find for themselves."""
    def hint(where: Mapping[int, Sequence[int]]) -> str:
        ranks: dict[str, set[int]] = {}  # module path -> the ranks whose collective has its params
        for r in sorted(where):
            n, first, last = where[r][3:6]
            for p in sorted({first, last}) if n > 0 else ():
                if 0 <= p < len(names):
                    ranks.setdefault(names[p].rpartition(".")[0], set()).add(r)
        found = leaf_parent(list(ranks), modules) if len(ranks) > 1 else None
        if found is None:
            return ""
        parent, cls = found
        seen = "; ".join(f"{m!r} on rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, sorted(rs)))}"
                         for m, rs in ranks.items())
        return (f"These are modules under one parent, {parent!r} ({cls}): {seen}. If {parent!r} picks which "
                "of its submodules run from its input (as an MoE routes tokens to experts), make it a leaf "
                f"module: fz3.set_leaf_modules(model, [{cls}]) before fz3.initialize (DeepSpeed: "
                f"deepspeed.utils.set_z3_leaf_modules(model, [{cls}]), or zero_optimization.leaf_module). "
                "A leaf is one fetch unit that every rank gathers and reduces whole, whichever submodules run.")
    return hint


def leaf_parent(paths: Sequence[str], modules: Sequence[tuple[str, type]]) -> tuple[str, str] | None:
    """(path, class name) of the nearest module that is, or is an ancestor of, each of the module
    `paths` and is called (its class defines forward; a ModuleList never is), other than the
    model itself; None when that is only the model. The module to make a leaf when those paths
    are the submodules a parent picked from its data (fz3.check names it too)."""
    called = {path: cls.__name__ for path, cls in modules if cls.forward is not torch.nn.Module.forward}
    parent = _common_parent(list(paths)) if paths else ""
    while parent and parent not in called:
        parent = parent.rpartition(".")[0]
    return (parent, called[parent]) if parent else None


def _common_parent(paths: Sequence[str]) -> str:
    """The longest dotted path that is, or is an ancestor of, each of `paths` ('' : the root)."""
    common = []
    for parts in zip(*(p.split(".") for p in paths)):
        if len(set(parts)) > 1:
            break
        common.append(parts[0])
    return ".".join(common)
