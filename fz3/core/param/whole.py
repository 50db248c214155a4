"""Which fetch units stay whole through a decode loop: the core's half of `engine.generation`.

    keep_whole(spec, budget) -> Whole(modules, params, numel)

[Note: generation keeps units whole] A decode loop runs the same forward once per token. Under
ZeRO-3 each forward gathers every unit again: a collective per unit per token (about 700 ms a
token for DeepSpeed's naive generate, DeepSpeedExamples#764). Holding a unit whole for the loop
(fz3/core/param/hold.py: a hold is a user, so no release frees it) costs its full values for the
loop's length and saves its gather at every token. Within a budget of `budget` elements of full
values beyond the persistent params (which are whole anyway), the units are kept smallest first,
each counted by the elements it adds (a param shared with a unit already kept costs nothing
again), and a unit that would overflow the budget is skipped for a later, smaller one: with no
shared params this keeps the most units a budget can hold (exchange argument: any set of k units
within the budget is at least as large as the k smallest), so the fewest are gathered per token.
Ties go to the module met first in the spec (its order, the model's). A unit whose params are all
persistent has nothing to gather and is never counted. `budget=None`: every unit.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

from fz3.core.ids import ModuleId, ParamId
from fz3.core.spec import ModelSpec


class Whole(NamedTuple):
    modules: tuple[ModuleId, ...]  # the units kept whole, in spec order
    params: tuple[ParamId, ...]  # their params not persistent, sorted: what the hold gathers
    numel: int  # the elements those params take whole


def units(spec: ModelSpec) -> list[tuple[ModuleId, tuple[ParamId, ...]]]:
    """Each unit with something to gather: its params that are not persistent."""
    out = []
    for m in spec.modules:
        ps = tuple(p for p in m.params if not spec.params[p].persistent)
        if ps:
            out.append((m.id, ps))
    return out


def keep_whole(spec: ModelSpec, budget: Optional[int]) -> Whole:
    """The units to hold whole within `budget` elements ([Note: generation keeps units whole])."""
    numel = [p.numel for p in spec.params]
    cands = units(spec)
    if budget is None:
        kept = {p for _, ps in cands for p in ps}
        return Whole(tuple(m for m, _ in cands), tuple(sorted(kept)), sum(numel[p] for p in kept))
    order = sorted(range(len(cands)), key=lambda i: (sum(numel[p] for p in cands[i][1]), i))
    kept: set[ParamId] = set()
    chosen, used = [], 0
    for i in order:
        m, ps = cands[i]
        extra = sum(numel[p] for p in ps if p not in kept)
        if used + extra <= budget:
            chosen.append(i)
            kept.update(ps)
            used += extra
    return Whole(tuple(cands[i][0] for i in sorted(chosen)), tuple(sorted(kept)), used)


def gathered_per_pass(spec: ModelSpec, whole: Whole) -> tuple[ModuleId, ...]:
    """The units a forward still gathers with `whole` held: those with a param not kept."""
    kept = set(whole.params)
    return tuple(m for m, ps in units(spec) if not kept.issuperset(ps))
