"""The parameter lifecycle's state, and the three primitive moves every transition is built from.

    NOT_AVAILABLE --gather--> INFLIGHT(h) --wait(h)--> AVAILABLE --free--> NOT_AVAILABLE

`gather`, `wait` and `free` update the state and return the matching effect; they never decide
*what* to move. The decisions live in fetch.py, release.py, trace.py and backward.py.

State is immutable. Per-param and per-module entries sit in persistent vectors (pvec.py), so a
move costs O(params moved). Params gathered since the last sweep are kept in a cons list
(`gathered`), so a sweep at the end of a pass visits what was gathered, not the whole model.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

from fz3.core.effects import AllGather, Free, Wait
from fz3.core.ids import Handle, ModuleId, ParamId, Status
from fz3.core.pvec import PVec
from fz3.core.spec import ModelSpec
from fz3.core.trace import TraceState, initial_trace, iter_cons  # noqa: F401 (re-export)

MAX_INFLIGHT = 2  # DeepSpeed's __max_ongoing_fetch_events: the oldest gather is waited past this

Effects = tuple  # tuple of effect records, in issue order


class ParamSlot(NamedTuple):
    """Dynamic state of one param. DeepSpeed keeps these as ds_* attributes on the Parameter."""

    status: Status
    handle: Optional[Handle]  # the gather it rides while INFLIGHT
    active: frozenset[ModuleId]  # modules between fetch and release that use it
    fetched_for: int  # trace step it was last fetched or prefetched for (-1: none)
    external: bool  # registered on a module that does not own it; freed at step end only


class ModuleSlot(NamedTuple):
    """Dynamic state of one fetch unit."""

    pre_backward: int  # DeepSpeed's applied_pre_backward_ref_cnt: +1 per forward call
    grads_remaining: int  # DeepSpeed's ds_grads_remaining: grad-requiring inputs not yet done
    fetch_step: int  # trace step of its latest fetch (-1: none this pass)
    externals: tuple[ParamId, ...]  # external params registered on it, sorted


class Inflight(NamedTuple):
    handle: Handle
    params: tuple[ParamId, ...]


Cons = Optional[tuple]  # (head, tail) linked list; None is empty

NA_SLOT = ParamSlot(Status.NOT_AVAILABLE, None, frozenset(), -1, False)
IDLE_MODULE = ModuleSlot(0, 0, -1, ())


class ParamState(NamedTuple):
    spec: ModelSpec
    params: PVec[ParamSlot]
    modules: PVec[ModuleSlot]
    live_numel: int  # numel of full params resident or in flight (DeepSpeed __n_available_params)
    peak_live_numel: int
    inflight: tuple[Inflight, ...]  # oldest first
    next_handle: int
    gathered: Cons  # params gathered since the last sweep (may repeat, may be stale)
    trace: TraceState


def initial_state(spec: ModelSpec) -> ParamState:
    """Every param NOT_AVAILABLE, no trace yet."""
    return ParamState(spec, PVec([NA_SLOT] * len(spec.params)), PVec([IDLE_MODULE] * len(spec.modules)),
                      0, 0, (), 0, None, initial_trace())


def gather(st: ParamState, pids: tuple[ParamId, ...], *, prefetch: bool, forward: bool,
           fetched_for: tuple[int, ...]) -> tuple[ParamState, Effects]:
    """Issue one AllGather for `pids` (all NOT_AVAILABLE, sorted); `fetched_for[i]` is the trace
    step pids[i] is gathered for. Waits the oldest in-flight gather first if MAX_INFLIGHT are
    already out (DeepSpeed's __max_ongoing_fetch_events)."""
    effects: Effects = ()
    if len(st.inflight) >= MAX_INFLIGHT:
        st, effects = wait(st, st.inflight[0].handle)
    h = Handle(st.next_handle)
    slots, spec, numel, gathered = st.params, st.spec.params, 0, st.gathered
    updates = []
    for p, step in zip(pids, fetched_for):
        s = slots[p]
        updates.append((p, s._replace(status=Status.INFLIGHT, handle=h, fetched_for=step)))
        numel += spec[p].numel
        gathered = (p, gathered)
    live = st.live_numel + numel
    st = st._replace(params=slots.set_many(updates), live_numel=live,
                     peak_live_numel=max(st.peak_live_numel, live),
                     inflight=st.inflight + (Inflight(h, pids),), next_handle=h + 1, gathered=gathered)
    return st, effects + (AllGather(h, pids, prefetch, forward),)


def wait(st: ParamState, handle: Handle) -> tuple[ParamState, Effects]:
    """Wait the in-flight gather `handle`: its params become AVAILABLE."""
    rest, pids = [], ()
    for f in st.inflight:
        if f.handle == handle:
            pids = f.params
        else:
            rest.append(f)
    slots = st.params
    updates = [(p, slots[p]._replace(status=Status.AVAILABLE, handle=None)) for p in pids]
    return st._replace(params=slots.set_many(updates), inflight=tuple(rest)), (Wait(handle),)


def wait_for(st: ParamState, pids: tuple[ParamId, ...]) -> tuple[ParamState, Effects]:
    """Wait every in-flight gather that carries one of `pids`, oldest first."""
    slots = st.params
    needed = {slots[p].handle for p in pids if slots[p].status is Status.INFLIGHT}
    effects: Effects = ()
    for f in st.inflight:
        if f.handle in needed:
            st, e = wait(st, f.handle)
            effects += e
    return st, effects


def drain(st: ParamState) -> tuple[ParamState, Effects]:
    """Wait every in-flight gather, oldest first (a handle is never left behind)."""
    effects: Effects = ()
    while st.inflight:
        st, e = wait(st, st.inflight[0].handle)
        effects += e
    return st, effects


def free(st: ParamState, pids: tuple[ParamId, ...]) -> tuple[ParamState, Effects]:
    """Drop the full values of `pids` (all AVAILABLE, sorted); clears their active sets."""
    if not pids:
        return st, ()
    slots, spec = st.params, st.spec.params
    updates = [(p, slots[p]._replace(status=Status.NOT_AVAILABLE, active=frozenset())) for p in pids]
    numel = sum(spec[p].numel for p in pids)
    return st._replace(params=slots.set_many(updates), live_numel=st.live_numel - numel), (Free(pids),)


def unit_params(st: ParamState, module: ModuleId) -> tuple[ParamId, ...]:
    """The params a fetch of `module` needs: its own plus the external ones registered on it."""
    own = st.spec.modules[module].params
    ext = st.modules[module].externals
    return own if not ext else tuple(sorted(set(own).union(ext)))
