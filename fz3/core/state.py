"""The parameter lifecycle's state, and the three primitive moves every transition is built from.

    NOT_AVAILABLE --gather--> INFLIGHT(h) --wait(h)--> AVAILABLE --free--> NOT_AVAILABLE

`gather`, `wait` and `free` update a transition's working copy (`Txn`) and log the matching
effect; they never decide *what* to move. The decisions live in fetch.py, release.py, trace.py and backward.py.

State is immutable. Per-param and per-module entries sit in persistent vectors (pvec.py), so a
move costs O(params moved). Params gathered since the last sweep are kept in a persistent log
(`gathered`), so a sweep at the end of a pass visits what was gathered, not the whole model.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

from fz3.core.effects import AllGather, Free, Wait
from fz3.core.ids import Handle, ModuleId, ParamId, Status
from fz3.core.pvec import Log, PVec
from fz3.core.spec import ModelSpec
from fz3.core.trace import TraceState, initial_trace

MAX_INFLIGHT = 2  # DeepSpeed's __max_ongoing_fetch_events: the oldest gather is waited past this

Effects = tuple  # tuple of effect records, in issue order


class ParamSlot(NamedTuple):
    """Dynamic state of one param, as a readable record (DeepSpeed keeps these as ds_*
    attributes on the Parameter). Stored as a plain tuple row, see [Note: rows]."""

    status: Status
    handle: Optional[Handle]  # the gather it rides while INFLIGHT
    users: int  # active modules (between fetch and release) whose unit holds it
    fetched_for: int  # trace step it was last fetched or prefetched for (-1: none)
    external: bool  # registered on a module that does not own it; freed at step end only


class ModuleSlot(NamedTuple):
    """Dynamic state of one fetch unit, as a readable record; stored as a plain tuple row."""

    pre_backward: int  # DeepSpeed's applied_pre_backward_ref_cnt: +1 per forward call
    grads_remaining: int  # DeepSpeed's ds_grads_remaining: grad-requiring inputs not yet done
    fetch_step: int  # trace step of its latest fetch (-1: none this pass)
    active: int  # open calls: fetches not yet released (forward: the call is running; backward:
    # between a call's pre- and post-backward). While > 0 its unit's params count it once in `users`
    externals: tuple[ParamId, ...]  # external params registered on it, sorted


# [Note: rows] The hot path stores each slot as a plain tuple of ints/None/bools, read by the
# column indices below, not as a NamedTuple of enums. Plain tuples of atoms are built by one
# bytecode and CPython's GC untracks them on first sight, so the tens of thousands of rows
# that survive a pass never reach the old generation; NamedTuple rows holding enum members
# made full collections, and so the cost per visit, grow with the model (bench/RESULTS.md).
# `ParamState.params[p]` / `.modules[m]` give the readable records.
STATUS, HANDLE, USERS, FETCHED_FOR, EXTERNAL = range(5)
PRE_BACKWARD, GRADS_REMAINING, FETCH_STEP, ACTIVE, EXTERNALS = range(5)
NOT_AVAILABLE, INFLIGHT, AVAILABLE = int(Status.NOT_AVAILABLE), int(Status.INFLIGHT), int(Status.AVAILABLE)
NA_ROW = (NOT_AVAILABLE, None, 0, -1, False)
IDLE_ROW = (0, 0, -1, 0, ())


class Inflight(NamedTuple):
    handle: Handle
    params: tuple[ParamId, ...]


class _Records:
    """Read-only sequence view turning rows into records (for checks, tests and display)."""

    __slots__ = ("rows", "make")

    def __init__(self, rows: PVec[tuple], make) -> None:
        self.rows, self.make = rows, make

    def __getitem__(self, i: int):
        return self.make(self.rows[i])

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self):
        return (self.make(r) for r in self.rows)


def _param_record(r: tuple) -> ParamSlot:
    return ParamSlot(Status(r[0]), *r[1:])


class ParamState(NamedTuple):
    spec: ModelSpec
    param_rows: PVec[tuple]  # ParamSlot rows, by ParamId
    module_rows: PVec[tuple]  # ModuleSlot rows, by ModuleId
    live_numel: int  # numel of full params resident or in flight (DeepSpeed __n_available_params)
    peak_live_numel: int
    inflight: tuple[Inflight, ...]  # oldest first
    next_handle: int
    gathered: Log[ParamId]  # params gathered since the last sweep (may repeat, may be stale)
    trace: TraceState
    held: tuple[ParamId, ...] = ()  # held whole by gathered_parameters (sorted, may repeat)

    @property
    def params(self) -> _Records:
        """params[p] -> ParamSlot"""
        return _Records(self.param_rows, _param_record)

    @property
    def modules(self) -> _Records:
        """modules[m] -> ModuleSlot"""
        return _Records(self.module_rows, ModuleSlot._make)


def initial_state(spec: ModelSpec) -> ParamState:
    """Every param NOT_AVAILABLE, no trace yet."""
    return ParamState(spec, PVec([NA_ROW] * len(spec.params)), PVec([IDLE_ROW] * len(spec.modules)),
                      0, 0, (), 0, Log(), initial_trace())


class Txn:
    """A transient: one transition's private, mutable working copy of a ParamState.

    Why: a fetch touches the same few params several times (activate, gather, wait, prefetch);
    building a new immutable state at each touch would dominate the cost. A Txn edits the next
    version of the per-param and per-module vectors in place (`PVec.begin`) and `commit`
    builds the new state record once. The old state still reads its own values, and the Txn
    never escapes the transition that made it, so transitions stay pure functions of
    (state, event).
    """

    __slots__ = ("st", "param_rows", "slots", "olds", "module_rows", "mods", "mod_olds", "live",
                 "peak", "inflight", "next_handle", "gathered", "trace", "effects")

    def __init__(self, st: ParamState) -> None:
        self.st = st
        self.param_rows, self.slots, self.olds = st.param_rows.begin()
        self.module_rows, self.mods, self.mod_olds = st.module_rows.begin()
        self.live, self.peak, self.inflight = st.live_numel, st.peak_live_numel, list(st.inflight)
        self.next_handle, self.gathered, self.trace = st.next_handle, st.gathered, st.trace
        self.effects: list = []

    def put(self, p: ParamId, row: tuple) -> None:
        if p not in self.olds:
            self.olds[p] = self.slots[p]
        self.slots[p] = row

    def put_module(self, m: ModuleId, row: tuple) -> None:
        if m not in self.mod_olds:
            self.mod_olds[m] = self.mods[m]
        self.mods[m] = row

    def commit(self) -> tuple[ParamState, Effects]:
        return ParamState(self.st.spec, self.param_rows, self.module_rows, self.live, self.peak,
                          tuple(self.inflight), self.next_handle, self.gathered,
                          self.trace, self.st.held), tuple(self.effects)


def gather(tx: Txn, pids: tuple[ParamId, ...], *, prefetch: bool, forward: bool,
           fetched_for: tuple[int, ...]) -> None:
    """Issue one AllGather for `pids` (all NOT_AVAILABLE, sorted); `fetched_for[i]` is the trace
    step pids[i] is gathered for. Waits the oldest in-flight gather first if MAX_INFLIGHT are
    already out (DeepSpeed's __max_ongoing_fetch_events)."""
    if len(tx.inflight) >= MAX_INFLIGHT:
        wait(tx, tx.inflight[0].handle)
    h = tx.next_handle
    spec, slots, olds, numel = tx.st.spec.params, tx.slots, tx.olds, 0
    for p, step in zip(pids, fetched_for):
        s = slots[p]
        if p not in olds:
            olds[p] = s
        slots[p] = (INFLIGHT, h, s[USERS], step, s[EXTERNAL])
        numel += spec[p].numel
    tx.live += numel
    if tx.live > tx.peak:
        tx.peak = tx.live
    tx.inflight.append(Inflight(h, pids))
    tx.next_handle, tx.gathered = h + 1, tx.gathered.extend(pids)
    tx.effects.append(AllGather(h, pids, prefetch, forward))


def wait(tx: Txn, handle: Handle) -> None:
    """Wait the in-flight gather `handle`: its params become AVAILABLE."""
    inflight, slots, olds = tx.inflight, tx.slots, tx.olds
    i = 0
    while inflight[i].handle != handle:
        i += 1
    for p in inflight.pop(i).params:
        s = slots[p]
        if p not in olds:
            olds[p] = s
        slots[p] = (AVAILABLE, None, s[USERS], s[FETCHED_FOR], s[EXTERNAL])
    tx.effects.append(Wait(handle))


def wait_for(tx: Txn, pids: tuple[ParamId, ...]) -> None:
    """Wait every in-flight gather that carries one of `pids`, oldest first."""
    if not tx.inflight:
        return
    slots = tx.slots
    needed = {slots[p][HANDLE] for p in pids if slots[p][STATUS] == INFLIGHT}
    if needed:
        for f in [f for f in tx.inflight if f.handle in needed]:
            wait(tx, f.handle)


def drain(tx: Txn) -> None:
    """Wait every in-flight gather, oldest first (a handle is never left behind)."""
    while tx.inflight:
        wait(tx, tx.inflight[0].handle)


def free(tx: Txn, pids: tuple[ParamId, ...], refetch: bool = False) -> None:
    """Drop the full values of `pids` (all AVAILABLE, sorted); nobody uses them any more.
    `refetch`: the releasing module fetches them again in this pass (see effects.Free)."""
    if not pids:
        return
    spec, slots, olds, numel = tx.st.spec.params, tx.slots, tx.olds, 0
    for p in pids:
        s = slots[p]
        if p not in olds:
            olds[p] = s
        slots[p] = (NOT_AVAILABLE, None, 0, s[FETCHED_FOR], s[EXTERNAL])
        numel += spec[p].numel
    tx.live -= numel
    tx.effects.append(Free(pids, refetch))


def unit_params(tx: Txn, module: ModuleId) -> tuple[ParamId, ...]:
    """The params a fetch of `module` needs: its own plus the external ones registered on it."""
    own = tx.st.spec.modules[module].params
    ext = tx.mods[module][EXTERNALS]
    return own if not ext else tuple(sorted(set(own).union(ext)))


def unit_of(st: ParamState, module: ModuleId) -> tuple[ParamId, ...]:
    """`unit_params` read off a state (for checks and tests; starts no edit)."""
    own = st.spec.modules[module].params
    ext = st.module_rows[module][EXTERNALS]
    return own if not ext else tuple(sorted(set(own).union(ext)))
