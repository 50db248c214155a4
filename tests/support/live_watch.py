"""Watching live full-param memory in a running engine (for the parity tests' I1 checks).

    LiveWatch(engine)    wraps the engine's event door; after every event splits
                         the live numel into pinned (active units, held, persistent, external)
                         and budgeted (prefetched, kept for reuse), and keeps the peaks
    unit_bounds(engine)  per module: its fetch unit's numel, and the sum along its ancestor chain
"""
from __future__ import annotations

import sys

from fz3.core.param.state import NOT_AVAILABLE, unit_of


class LiveWatch:
    """After every parameter event of `engine`, split the live full-param numel into what is
    pinned (params of active modules, held, persistent or external: fetched on demand, never
    refused) and the rest (prefetched, or kept for reuse), which I1 bounds by
    max_live_parameters at every event, not only right after a prefetch."""

    def __init__(self, engine) -> None:
        self.engine, self.run = engine, engine.apply
        self.numel = [p.numel for p in engine.spec.params]
        self.persistent = [p.persistent for p in engine.spec.params]
        self.budget_max = self.pinned_max = self.peak = 0
        self.detail = ""
        engine.apply = self  # the hooks call self.apply(event, tree): the instance's comes first

    def __call__(self, event, tree=None, flat=None):
        out = self.run(event, tree, flat)
        self.check()
        return out

    def check(self) -> None:
        st, numel = self.engine.params_state, self.numel
        live = [p for p in range(len(st.spec.params)) if st.status(p) != NOT_AVAILABLE]
        active = [m for m in range(len(st.spec.modules)) if st.active(m)]
        pinned = set(st.held)
        for m in active:
            pinned.update(unit_of(st, m))
        pinned.update(p for p in live if self.persistent[p] or st.is_external(p))
        total = sum(numel[p] for p in live)
        pinned_n = sum(numel[p] for p in live if p in pinned)
        self.budget_max = max(self.budget_max, total - pinned_n)
        self.pinned_max = max(self.pinned_max, pinned_n)
        if total > self.peak:
            self.peak = total
            names = self.engine.tables.module_names
            mods = ", ".join(f"{names[m] or '<root>'}:{sum(numel[p] for p in unit_of(st, m))}" for m in active)
            self.detail = (f"live {total} at {sys._getframe(2).f_code.co_name}: active [{mods}], "
                           f"pinned {pinned_n}, budgeted {total - pinned_n}")


def unit_bounds(engine) -> tuple[list[int], list[int]]:
    """Per registered module: its fetch unit's numel (own params + externals registered on it),
    and the sum of the units on its chain of registered ancestors (itself included)."""
    numel = [p.numel for p in engine.spec.params]
    st = engine.state.params
    units = [sum(numel[p] for p in unit_of(st, m)) for m in range(len(engine.spec.modules))]
    names = engine.tables.module_names
    index = {n: m for m, n in enumerate(names)}
    chains = []
    for m, name in enumerate(names):
        total, parts = units[m], name.split(".") if name else []
        for k in range(len(parts)):
            parent = ".".join(parts[:k])
            if parent in index:
                total += units[index[parent]]
        chains.append(total)
    return units, chains
