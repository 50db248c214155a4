"""fz3.plan under optimizer offload: what stays in memory, what each step moves to and from disk,
and, given the memory a rank has, how much of the optimizer to offload so the plan fits.

    figures(engine, rate, stepped)      the offload's rows of a planned step (bytes on disk,
                                        read and written per step, the step's working set, and
                                        the masters and state that leave memory)
    choose(figures_of, budget)          the smallest share of the sub-groups to offload, as
                                        DeepSpeed's `ratio` picks them, that brings the plan's
                                        peak within `budget`; None if even all of them does not

A sub-group's bytes are its fp32 masters and the elementwise optimizer state the plan measures
for its params (fz3/observe/plan.py `_optimizer_state_rate`; the per-param scalars, Adam's step
counts, stay in memory). The sub-groups are fz3/core/offload.py's,
from the planned engine's segments (cut at sub_group_size when the config offloads to "nvme").
Under offload the step holds `budget(pipeline_read, pipeline_write)` offloaded sub-groups in
memory at once: the plan counts the largest ones that many times.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from fz3.core import offload


class OffloadFigures(NamedTuple):
    ratio: float
    subgroups: int
    offloaded: tuple[int, ...]  # sub-group indices
    first_params: tuple[str, ...]  # by offloaded sub-group: the name of its first param
    bytes_offloaded: int  # masters + optimizer state of the offloaded sub-groups, on disk
    masters_offloaded: int  # of which the fp32 masters
    disk_read: int  # per optimizer step
    disk_written: int
    working_set: int  # offloaded sub-groups in memory at once during the step, at most


def groups_of(engine, ratio: float) -> tuple[offload.SubGroup, ...]:
    store = engine.store
    runs: list[list[tuple[int, int]]] = [[] for _ in store.runs]
    for k, seg in enumerate(store.segments):
        runs[seg.run].append((k, seg.masters.numel()))
    return offload.sub_groups(runs, sub_group_size=engine.config.sub_group_size, ratio=ratio)


def figures(engine, rate: tuple[int, int], stepped: set[int], ratio: float | None = None) -> OffloadFigures:
    """The offload's figures for the planned engine, at `ratio` (None: the config's)."""
    cfg = engine.config.offload_optimizer
    ratio = cfg.ratio if ratio is None else ratio
    store = engine.store
    groups = groups_of(engine, ratio)
    _, per_elem = rate
    sizes, masters = [], []
    for g in groups:
        ps = [p for s in g.segments for p in store.segments[s].params]
        masters.append(sum(4 * store.masters[p].numel() for p in ps))
        # the elementwise state moves; the per-param scalars (Adam's step count) stay in memory
        sizes.append(masters[-1] + sum(per_elem * store.masters[p].numel() for p in ps if p in stepped))
    off = tuple(i for i, g in enumerate(groups) if g.offloaded)
    moved = sum(sizes[i] for i in off)
    held = sorted((sizes[i] for i in off), reverse=True)[:offload.budget(cfg.pipeline_read, cfg.pipeline_write)]
    names = tuple(store.names[store.segments[groups[i].segments[0]].params[0]] for i in off)
    return OffloadFigures(ratio, len(groups), off, names, moved, sum(masters[i] for i in off), moved, moved,
                          sum(held))


def ratios(n: int) -> list[float]:
    """A ratio for each count k = 0..n of offloaded sub-groups under DeepSpeed's rule (sub-group i
    of n is offloaded when i >= int((1 - ratio) * n)): 0, 1, and between them the middle of the
    interval that gives k, rounded to a short decimal that still gives it (a user copies it)."""
    out = []
    for k in range(n + 1):
        r = 0.0 if k == 0 else 1.0 if k == n else round((k - 0.5) / n, len(str(n)) + 1)
        assert n - int((1 - r) * n) == k, (n, k, r)
        out.append(r)
    return out


def choose(peak_at: Callable[[float], int], n: int, budget: int) -> float | None:
    """The smallest ratio whose planned peak (`peak_at(ratio)`) is within `budget` bytes; None if
    none is."""
    for r in ratios(n):
        if peak_at(r) <= budget:
            return r
    return None
