"""Invariants of the parameter lifecycle, written once.

Used by the unit tests, the Hypothesis machines (fz3/testing) and the shell's debug mode
(`fz3.Options.debug_checks`). Each raises InvariantError naming what broke. They walk the whole model,
so they are for checking, never for the hot path.

    check_state       structural: live numel adds up, handles and INFLIGHT agree, <= 2 in flight,
                      an active param is AVAILABLE, counters >= 0
    check_fetched     a module about to compute has every param AVAILABLE
    check_live_budget I1: a fetch that prefetched left live numel <= max_live_parameters
    check_prefetch_reach  a fetch that prefetched left the params gathered ahead of need (for a
                      later step of the pass) within prefetch_bucket_size plus one param of them
    check_quiescent   I2: after a whole forward+backward nothing is in flight, every
                      non-persistent non-external param is NOT_AVAILABLE, counters are 0
"""
from __future__ import annotations

from fz3.config.config import Config
from fz3.core.effects import AllGather
from fz3.core.ids import ModuleId, Status
from fz3.core.param.state import Effects, ParamState, unit_of


class InvariantError(AssertionError):
    """A lifecycle invariant does not hold; the message names the param or module."""


def _fail(msg: str) -> None:
    raise InvariantError(msg)


def check_state(st: ParamState) -> None:
    spec = st.spec
    live = 0
    handles = {f.handle: f.params for f in st.inflight}
    if len(st.inflight) > spec.max_inflight:
        _fail(f"{len(st.inflight)} gathers in flight, at most {spec.max_inflight} allowed (max_ongoing_fetch_events)")
    for p, s in enumerate(st.params):
        name = spec.params[p].name
        if s.status is not Status.NOT_AVAILABLE:
            live += spec.params[p].numel
        if s.status is Status.INFLIGHT and (s.handle not in handles or p not in handles[s.handle]):
            _fail(f"param {name} is INFLIGHT on handle {s.handle}, which is not in flight with it")
        if s.status is not Status.INFLIGHT and s.handle is not None:
            _fail(f"param {name} is {s.status.name} but still holds handle {s.handle}")
        if s.users and s.status is not Status.AVAILABLE:
            _fail(f"param {name} has {s.users} active users but is {s.status.name}")
    for h, pids in handles.items():
        for p in pids:
            if st.params[p].status is not Status.INFLIGHT:
                _fail(f"handle {h} is in flight but carries {spec.params[p].name}, which is "
                      f"{st.params[p].status.name}")
    users = [0] * len(spec.params)
    for p in st.held:
        users[p] += 1
    for m, ms in enumerate(st.modules):
        if ms.active:
            for p in unit_of(st, m):
                users[p] += 1
    for p, s in enumerate(st.params):
        if s.users != users[p]:
            _fail(f"param {spec.params[p].name} counts {s.users} users, but {users[p]} active "
                  "modules hold it")
    if live != st.live_numel:
        _fail(f"live numel is {st.live_numel} but the gathered params add up to {live}")
    for m, ms in enumerate(st.modules):
        if ms.pre_backward < 0 or ms.grads_remaining < 0:
            _fail(f"module {spec.modules[m].name} has negative counters {ms}")


def check_fetched(st: ParamState, module: ModuleId) -> None:
    for p in unit_of(st, module):
        s = st.params[p]
        if s.status is not Status.AVAILABLE or not s.users or not st.modules[module].active:
            _fail(f"module {st.spec.modules[module].name} computes with param "
                  f"{st.spec.params[p].name}, which is {s.status.name} with {s.users} users "
                  f"(module active: {st.modules[module].active})")


def check_live_budget(after: ParamState, effects: Effects, *, config: Config) -> None:
    if any(isinstance(e, AllGather) and e.prefetch for e in effects):
        if after.live_numel > config.max_live_parameters:
            _fail(f"prefetch left {after.live_numel} elements live, over max_live_parameters="
                  f"{config.max_live_parameters}")


def check_prefetch_reach(after: ParamState, effects: Effects, *, config: Config) -> None:
    """[Note: prefetch bounds] (fz3/core/param/fetch.py): prefetch reaches prefetch_bucket_size
    elements of the plan past the current step, so what it has gathered for later steps (params
    gathered or in flight, marked for a step after the latest fetch's) adds up to at most the
    bucket plus the largest of them. Persistent, external and held params stay gathered across
    passes with their marks from earlier passes: they are not ahead of anything."""
    if not any(isinstance(e, AllGather) and e.prefetch for e in effects):
        return
    spec, now, held = after.spec.params, after.trace.step_id - 1, set(after.held)
    ahead = [p for p, s in enumerate(after.params)
             if s.status is not Status.NOT_AVAILABLE and s.fetched_for > now and not s.external
             and not spec[p].persistent and p not in held]
    numel = sum(spec[p].numel for p in ahead)
    if ahead and numel > config.prefetch_bucket_size + max(spec[p].numel for p in ahead):
        _fail(f"prefetch left {numel} elements gathered ahead of step {now} "
              f"({', '.join(spec[p].name for p in ahead)}), more than prefetch_bucket_size="
              f"{config.prefetch_bucket_size} plus one param")


def check_quiescent(st: ParamState) -> None:
    if st.inflight:
        _fail(f"gathers still in flight after the pass: {[f.handle for f in st.inflight]}")
    spec = st.spec
    holds: dict[int, int] = {}  # an open gathered_parameters may span passes: its users stay
    for p in st.held:
        holds[p] = holds.get(p, 0) + 1
    for p, s in enumerate(st.params):
        ps = spec.params[p]
        held = holds.get(p, 0)
        if s.status is not Status.NOT_AVAILABLE and not (ps.persistent or s.external or held):
            _fail(f"param {ps.name} is {s.status.name} after the pass (not persistent, not external, "
                  "not held)")
        if s.users != held:
            _fail(f"param {ps.name} still has {s.users} users after the pass ({held} holds)")
    for m, ms in enumerate(st.modules):
        if ms.pre_backward or ms.grads_remaining:
            _fail(f"module {spec.modules[m].name} has pre_backward={ms.pre_backward}, "
                  f"grads_remaining={ms.grads_remaining} after the pass")
