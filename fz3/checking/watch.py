"""One thread rank under fz3.check's eye: every core event it runs, and I1, the prefetch reach
and I2 after each.

    watch = Watch(engine)       # wraps the engine's core door (engine.update), as fz3.timeline does
    watch.micro = i             # the rank's loop says which micro-step runs
    watch.effects[i]            # the effects micro-step i's events returned, in order
    watch.entered[i]            # the modules micro-step i entered (Enter events), by name: every
                                # call, a quiet module's inside another too (engine.every_call)
    watch.callers[i]            # for each, the module whose forward ran around it ('' at the top)
    watch.i1, watch.reach, watch.i2   # the first violation of each, or None
    watch.active()              # the modules whose forward runs now, innermost last

Every rank's core is deterministic and rank-agnostic (docs/architecture.md, "Two planes"), so the effect streams are
what fz3.check compares: between two runs of one example (determinism, I6) and between the ranks
of one run (no divergence: ranks fed the same module events emit the same effects). The module
names entered say where the ranks' (or the passes') calls departed from each other.

    I1  after every event: the live full-param numel that nothing pins (an active module's
        unit, a gathered_parameters hold, a persistent or external param) is at most
        max_live_parameters (the parity tests' LiveWatch, tests/support/live_watch.py)
    prefetch reach  after every event that prefetched: check_prefetch_reach
        (fz3/core/param/invariants.py): the params gathered for later steps of the pass hold at
        most prefetch_bucket_size plus one param ([Note: prefetch bounds])
    I2  after every BackwardEnded: check_quiescent (fz3/core/param/invariants.py): no gather in
        flight, counters back to 0, every non-persistent non-external param NOT_AVAILABLE

The I1 split is computed only when the live numel exceeds the budget (nothing can be over it
otherwise), so a watch costs a list append per event on most configs.
"""
from __future__ import annotations

from fz3.core import replay
from fz3.core.events import BackwardEnded, Enter, Leave, Raised
from fz3.core.param.invariants import InvariantError, check_prefetch_reach, check_quiescent
from fz3.core.param.state import NOT_AVAILABLE, unit_of


class Watch:
    def __init__(self, engine) -> None:
        self.engine = engine
        self.names = [n or "<root>" for n in engine.tables.module_names]
        self.numel = [p.numel for p in engine.spec.params]
        self.persistent = [p.persistent for p in engine.spec.params]
        self.budget = engine.config.max_live_parameters
        self.config = engine.config
        self.micro = 0
        self.effects: dict[int, list] = {}
        self.entered: dict[int, list[str]] = {}
        self.callers: dict[int, list[str]] = {}
        self.stack: list[int] = []
        self.i1: str | None = None
        self.reach: str | None = None
        self.i2: str | None = None
        self.inner = engine.update
        engine.update = self.update  # the instance's attribute: the engine's own calls come here
        engine.every_call = True  # the quiet modules' calls inside others too ([Note: inert modules])

    def update(self, cell, event, *, config):
        new, effects = self.inner(cell, event, config=config)
        params = replay.view(new).params  # the core's cell (fz3/core/replay.py); params: exact
        self.effects.setdefault(self.micro, []).extend(effects)
        kind = type(event)
        if kind is Enter:
            self.entered.setdefault(self.micro, []).append(self.names[event.module])
            self.callers.setdefault(self.micro, []).append(self.names[self.stack[-1]] if self.stack else "")
            self.stack.append(event.module)
        elif kind is Leave or kind is Raised:
            if event.module in self.stack:
                del self.stack[len(self.stack) - 1 - self.stack[::-1].index(event.module)]
        if self.i1 is None and params.live_numel > self.budget:
            self._live_budget(params, kind.__name__)
        if self.reach is None:  # a no-op unless the event prefetched
            try:
                check_prefetch_reach(params, effects, config=self.config)
            except InvariantError as e:
                self.reach = f"micro-step {self.micro}, after {kind.__name__}: {e}"
        if self.i2 is None and kind is BackwardEnded:
            try:
                check_quiescent(params)
            except InvariantError as e:
                self.i2 = f"micro-step {self.micro}, after the backward: {e}"
        return new, effects

    def active(self) -> list[str]:
        return [self.names[m] for m in self.stack]

    def _live_budget(self, st, event: str) -> None:
        """I1 at this event: the live numel nothing pins must fit max_live_parameters."""
        live = [p for p in range(len(self.numel)) if st.status(p) != NOT_AVAILABLE]
        pinned = set(st.held)
        for m in range(len(st.spec.modules)):
            if st.active(m):
                pinned.update(unit_of(st, m))
        pinned.update(p for p in live if self.persistent[p] or st.is_external(p))
        free = [p for p in live if p not in pinned]
        budgeted = sum(self.numel[p] for p in free)
        if budgeted > self.budget:
            names = self.engine.tables.names
            shown = ", ".join(f"{names[p]} ({self.numel[p]})" for p in free[:6]) + (", ..." if len(free) > 6 else "")
            self.i1 = (f"micro-step {self.micro}, after {event}: {budgeted} live elements that no active module, "
                       f"hold, persistence or external registration pins, over max_live_parameters={self.budget}: "
                       f"{shown}")
