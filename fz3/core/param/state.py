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

from fz3.core.effects import AllGather, DropSecondary, Free, Refresh, Wait
from fz3.core.ids import Handle, ModuleId, ParamId, Status
from fz3.core.pvec import Log, PVec
from fz3.core.spec import ModelSpec
from fz3.core.param.trace import TraceState, initial_trace

MAX_INFLIGHT = 2  # DeepSpeed's __max_ongoing_fetch_events, the default of Config.max_ongoing_fetch_events
# (ModelSpec.max_inflight): the oldest gather is waited past it

Effects = tuple  # tuple of effect records, in issue order


class ParamSlot(NamedTuple):
    """Dynamic state of one param, as a readable record (DeepSpeed keeps these as ds_*
    attributes on the Parameter). Stored as a plain tuple row, see [Note: rows]."""

    status: Status
    handle: Optional[Handle]  # the gather it rides while INFLIGHT
    users: int  # active modules (between fetch and release) whose unit holds it
    fetched_for: int  # trace step it was last fetched or prefetched for (-1: none)
    external: bool  # registered on a module that does not own it; freed at step end only
    secondary: bool = False  # hpZ: this rank keeps its secondary shard ([Note: hpZ], fz3/core/stage.py)


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
#
# The encoding is this file's alone: the column numbers are private, and every other file reads
# a row by a named accessor (`ParamState.status(p)`, `Txn.users(p)`, ...) and changes it by a
# named move on `Txn` (`open_call`, `close_call`, `add_externals`, ...). tests/test_rows_are_private.py checks it.
_STATUS, _HANDLE, _USERS, _FETCHED_FOR, _EXTERNAL, _SECONDARY = range(6)
_PRE_BACKWARD, _GRADS_REMAINING, _FETCH_STEP, _ACTIVE, _EXTERNALS = range(5)
NOT_AVAILABLE, INFLIGHT, AVAILABLE = int(Status.NOT_AVAILABLE), int(Status.INFLIGHT), int(Status.AVAILABLE)
_NA_ROW = (NOT_AVAILABLE, None, 0, -1, False, False)
_IDLE_ROW = (0, 0, -1, 0, ())


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

    # named reads of one field (the hot path's way in: no record is built)
    def status(self, p: ParamId) -> int:
        """int(Status) of param `p`; compare with NOT_AVAILABLE / INFLIGHT / AVAILABLE."""
        return self.param_rows[p][_STATUS]

    def is_external(self, p: ParamId) -> bool:
        return self.param_rows[p][_EXTERNAL]

    def externals(self, m: ModuleId) -> tuple[ParamId, ...]:
        """The external params registered on module `m`, sorted."""
        return self.module_rows[m][_EXTERNALS]

    def grads_remaining(self, m: ModuleId) -> int:
        return self.module_rows[m][_GRADS_REMAINING]

    def pre_backward(self, m: ModuleId) -> int:
        return self.module_rows[m][_PRE_BACKWARD]

    def active(self, m: ModuleId) -> int:
        return self.module_rows[m][_ACTIVE]

    def with_slots(self, params: Optional[dict] = None, modules: Optional[dict] = None) -> "ParamState":
        """This state with some slots replaced: `params` maps ParamId -> ParamSlot, `modules`
        ModuleId -> ModuleSlot (for tests that build a state by hand; no transition uses it)."""
        rows = {p: (int(r.status),) + tuple(r)[1:] for p, r in (params or {}).items()}
        return self._replace(param_rows=self.param_rows.set_many(rows),
                             module_rows=self.module_rows.set_many({m: tuple(r) for m, r in (modules or {}).items()}))


def copied(st: ParamState) -> ParamState:
    """`st` in vectors of its own: the same values, sharing no PVec lineage with `st` (an old
    version reaches every later version's diffs, pvec.py; fz3/core/replay.py [Note: schedules
    keep their own lineage]). O(params + modules)."""
    return st._replace(param_rows=PVec(st.param_rows.current()), module_rows=PVec(st.module_rows.current()))


def initial_state(spec: ModelSpec) -> ParamState:
    """Every param NOT_AVAILABLE, no trace yet."""
    return ParamState(spec, PVec([_NA_ROW] * len(spec.params)), PVec([_IDLE_ROW] * len(spec.modules)),
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

    __slots__ = ("st", "_param_rows", "_slots", "_olds", "_module_rows", "_mods", "_mod_olds", "live",
                 "peak", "inflight", "next_handle", "gathered", "trace", "effects")

    def __init__(self, st: ParamState) -> None:
        self.st = st
        self._param_rows, self._slots, self._olds = st.param_rows.begin()
        self._module_rows, self._mods, self._mod_olds = st.module_rows.begin()
        self.live, self.peak, self.inflight = st.live_numel, st.peak_live_numel, list(st.inflight)
        self.next_handle, self.gathered, self.trace = st.next_handle, st.gathered, st.trace
        self.effects: list = []

    def _put(self, p: ParamId, row: tuple) -> None:
        if p not in self._olds:
            self._olds[p] = self._slots[p]
        self._slots[p] = row

    def _put_module(self, m: ModuleId, row: tuple) -> None:
        if m not in self._mod_olds:
            self._mod_olds[m] = self._mods[m]
        self._mods[m] = row

    # -- named reads of the working copy --
    def status(self, p: ParamId) -> int:
        return self._slots[p][_STATUS]

    def users(self, p: ParamId) -> int:
        return self._slots[p][_USERS]

    def fetched_for(self, p: ParamId) -> int:
        return self._slots[p][_FETCHED_FOR]

    def is_external(self, p: ParamId) -> bool:
        return self._slots[p][_EXTERNAL]

    def externals(self, m: ModuleId) -> tuple[ParamId, ...]:
        return self._mods[m][_EXTERNALS]

    def active(self, m: ModuleId) -> int:
        return self._mods[m][_ACTIVE]

    def pre_backward(self, m: ModuleId) -> int:
        return self._mods[m][_PRE_BACKWARD]

    def grads_remaining(self, m: ModuleId) -> int:
        return self._mods[m][_GRADS_REMAINING]

    def fetch_step(self, m: ModuleId) -> int:
        return self._mods[m][_FETCH_STEP]

    # -- named moves on params --
    def add_user(self, pids: tuple[ParamId, ...]) -> list[ParamId]:
        """Each of `pids` gains one user (a hold). -> the NOT_AVAILABLE ones, in order."""
        missing = []
        for p in pids:
            s = self._slots[p]
            self._put(p, (s[_STATUS], s[_HANDLE], s[_USERS] + 1, s[_FETCHED_FOR], s[_EXTERNAL], s[_SECONDARY]))
            if s[_STATUS] == NOT_AVAILABLE:
                missing.append(p)
        return missing

    def set_users(self, p: ParamId, users: int) -> None:
        s = self._slots[p]
        if s[_USERS] != users:
            self._put(p, (s[_STATUS], s[_HANDLE], users, s[_FETCHED_FOR], s[_EXTERNAL], s[_SECONDARY]))

    # -- named moves on modules --
    def open_call(self, m: ModuleId, step: int, grad_inputs: int) -> tuple[tuple[ParamId, ...], list[ParamId]]:
        """A call of `m`, fetched at trace step `step`, opens; `grad_inputs` (0 or 1) more
        post-backwards are due. If no other call of `m` is open, `m` is counted once among the
        users of its unit's params. Each of them is marked fetched for `step` unless it already
        is for a later one. -> (its unit, the unit's NOT_AVAILABLE params in order: to gather)."""
        ms = self._mods[m]
        self._put_module(m, (ms[_PRE_BACKWARD], ms[_GRADS_REMAINING] + grad_inputs, step,
                             ms[_ACTIVE] + 1, ms[_EXTERNALS]))
        pids = _unit(self.st.spec.modules[m].params, ms[_EXTERNALS])
        users = 0 if ms[_ACTIVE] else 1
        slots, olds, missing = self._slots, self._olds, []
        for p in pids:
            s = slots[p]
            if p not in olds:
                olds[p] = s
            ff = s[_FETCHED_FOR]
            slots[p] = (s[_STATUS], s[_HANDLE], s[_USERS] + users, step if step > ff else ff, s[_EXTERNAL],
                        s[_SECONDARY])
            if s[_STATUS] == NOT_AVAILABLE:
                missing.append(p)
        return pids, missing

    def close_call(self, m: ModuleId) -> list[ParamId]:
        """One open call of `m` closes (none open: nothing changes). At the last, `m` is counted
        out of its unit's users. -> the params that may be freed now: AVAILABLE, no user left,
        not persistent, not external (none while another call of `m` stays open)."""
        ms = self._mods[m]
        if not ms[_ACTIVE]:
            return []  # not fetched since its last release (e.g. after a forced sweep)
        self._put_module(m, (ms[_PRE_BACKWARD], ms[_GRADS_REMAINING], ms[_FETCH_STEP],
                             ms[_ACTIVE] - 1, ms[_EXTERNALS]))
        if ms[_ACTIVE] > 1:
            return []  # another call of it is still open (backward of calls that interleave)
        spec, slots, olds, candidates = self.st.spec.params, self._slots, self._olds, []
        for p in _unit(self.st.spec.modules[m].params, ms[_EXTERNALS]):
            s = slots[p]
            if p not in olds:
                olds[p] = s
            users = s[_USERS] - 1
            slots[p] = (s[_STATUS], s[_HANDLE], users, s[_FETCHED_FOR], s[_EXTERNAL], s[_SECONDARY])
            if not users and s[_STATUS] == AVAILABLE and not s[_EXTERNAL] and not spec[p].persistent:
                candidates.append(p)
        return candidates

    def not_available_fitting(self, queue: tuple[tuple[int, ParamId], ...], i: int, reach: int,
                              room: int) -> tuple[dict[ParamId, int], int]:
        """Walk `queue` ((step, param) pairs) from index `i` up to index `reach`, taking
        NOT_AVAILABLE params not yet taken; stop before one that would take their numel past
        `room`. -> ({param: its step}, the index the walk stopped at). Prefetch's walk
        (fetch.py says what reach and room are)."""
        spec, slots, chosen, numel = self.st.spec.params, self._slots, {}, 0
        while i < reach:
            t, p = queue[i]
            if slots[p][_STATUS] == NOT_AVAILABLE and p not in chosen:
                n = spec[p].numel
                if numel + n > room:
                    break
                chosen[p] = t
                numel += n
            i += 1
        return chosen, i

    def sweep_gathered(self, force: bool) -> list[ParamId]:
        """The params gathered since the last sweep that nothing holds: AVAILABLE, not persistent,
        not external, not held (gathered_parameters) and, unless `force`, used by no active
        module. With `force` the rest are counted out of every module (their users = their
        holds). The log keeps the survivors. -> the ones to free, sorted."""
        spec, held, slots = self.st.spec.params, self.st.held, self._slots
        seen: set[ParamId] = set()
        to_free, survivors = [], []
        for p in self.gathered:
            if p in seen:
                continue
            seen.add(p)
            s = slots[p]
            if s[_STATUS] != AVAILABLE:
                continue
            holds = held.count(p) if held else 0
            if spec[p].persistent or s[_EXTERNAL] or holds or (s[_USERS] and not force):
                survivors.append(p)
                if force and s[_USERS] != holds:
                    self._put(p, (s[_STATUS], s[_HANDLE], holds, s[_FETCHED_FOR], s[_EXTERNAL], s[_SECONDARY]))
            else:
                to_free.append(p)
        self.gathered = Log(survivors)
        return sorted(to_free)

    def count_backward_fetch(self, m: ModuleId) -> None:
        """A forward call of `m` wrapped its outputs: its backward fetches it once more."""
        ms = self._mods[m]
        self._put_module(m, (ms[_PRE_BACKWARD] + 1,) + ms[1:])

    def take_backward_fetch(self, m: ModuleId) -> None:
        ms = self._mods[m]
        self._put_module(m, (ms[_PRE_BACKWARD] - 1,) + ms[1:])

    def take_backward_release(self, m: ModuleId) -> None:
        ms = self._mods[m]
        self._put_module(m, (ms[_PRE_BACKWARD], ms[_GRADS_REMAINING] - 1) + ms[2:])

    def add_externals(self, m: ModuleId, new: tuple[ParamId, ...]) -> list[ParamId]:
        """Register `new` (sorted, none already on `m`) on module `m` as external params: each
        is marked external and, if `m` is active, gains it as a user. -> the NOT_AVAILABLE ones."""
        ms = self._mods[m]
        users, missing = 1 if ms[_ACTIVE] > 0 else 0, []
        for p in new:
            s = self._slots[p]
            self._put(p, (s[_STATUS], s[_HANDLE], s[_USERS] + users, s[_FETCHED_FOR], True, s[_SECONDARY]))
            if s[_STATUS] == NOT_AVAILABLE:
                missing.append(p)
        self._put_module(m, ms[:_EXTERNALS] + (tuple(sorted(ms[_EXTERNALS] + new)),))
        return missing

    def idle(self, m: ModuleId) -> None:
        """Zero `m`'s backward counters and open calls; its externals stay."""
        ms = self._mods[m]
        if ms[:_EXTERNALS] != _IDLE_ROW[:_EXTERNALS]:
            self._put_module(m, _IDLE_ROW[:_EXTERNALS] + (ms[_EXTERNALS],))

    def commit(self) -> tuple[ParamState, Effects]:
        return ParamState(self.st.spec, self._param_rows, self._module_rows, self.live, self.peak,
                          tuple(self.inflight), self.next_handle, self.gathered,
                          self.trace, self.st.held), tuple(self.effects)


def gather(tx: Txn, pids: tuple[ParamId, ...], *, prefetch: bool, forward: bool,
           fetched_for: tuple[int, ...]) -> None:
    """Issue one AllGather for `pids` (all NOT_AVAILABLE, sorted); `fetched_for[i]` is the trace
    step pids[i] is gathered for. Waits the oldest in-flight gather first if the spec's
    max_inflight are already out (DeepSpeed's __max_ongoing_fetch_events: MAX_INFLIGHT)."""
    if len(tx.inflight) >= tx.st.spec.max_inflight:
        wait(tx, tx.inflight[0].handle)
    h = tx.next_handle
    spec, slots, olds, numel = tx.st.spec.params, tx._slots, tx._olds, 0
    for p, step in zip(pids, fetched_for):
        s = slots[p]
        if p not in olds:
            olds[p] = s
        slots[p] = (INFLIGHT, h, s[_USERS], step, s[_EXTERNAL], s[_SECONDARY])
        numel += spec[p].numel
    tx.live += numel
    if tx.live > tx.peak:
        tx.peak = tx.live
    tx.inflight.append(Inflight(h, pids))
    tx.next_handle, tx.gathered = h + 1, tx.gathered.extend(pids)
    # hpZ: the backward gathers what has a secondary shard from it ([Note: hpZ], stage.py)
    secondary = tuple(p for p in pids if slots[p][_SECONDARY]) if not forward and tx.st.spec.secondary > 1 else ()
    tx.effects.append(AllGather(h, pids, prefetch, forward, secondary))


def wait(tx: Txn, handle: Handle) -> None:
    """Wait the in-flight gather `handle`: its params become AVAILABLE."""
    inflight, slots, olds = tx.inflight, tx._slots, tx._olds
    i = 0
    while inflight[i].handle != handle:
        i += 1
    for p in inflight.pop(i).params:
        s = slots[p]
        if p not in olds:
            olds[p] = s
        slots[p] = (AVAILABLE, None, s[_USERS], s[_FETCHED_FOR], s[_EXTERNAL], s[_SECONDARY])
    tx.effects.append(Wait(handle))


def wait_for(tx: Txn, pids: tuple[ParamId, ...]) -> None:
    """Wait every in-flight gather that carries one of `pids`, oldest first."""
    if not tx.inflight:
        return
    slots = tx._slots
    needed = {slots[p][_HANDLE] for p in pids if slots[p][_STATUS] == INFLIGHT}
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
    spec, slots, olds, numel = tx.st.spec.params, tx._slots, tx._olds, 0
    keep = refetch and tx.st.spec.secondary > 1  # hpZ: its backward gathers from a secondary shard
    kept = []
    for p in pids:
        s = slots[p]
        if p not in olds:
            olds[p] = s
        if keep and not s[_SECONDARY]:
            kept.append(p)
        slots[p] = (NOT_AVAILABLE, None, 0, s[_FETCHED_FOR], s[_EXTERNAL], s[_SECONDARY] or keep)
        numel += spec[p].numel
    tx.live -= numel
    tx.effects.append(Free(pids, refetch, tuple(kept)))


def drop_secondary(tx: Txn, pids) -> None:
    """hpZ: the secondary shards of those of `pids` that have one go (their values are stale)."""
    slots, olds, dropped = tx._slots, tx._olds, []
    for p in pids:
        s = slots[p]
        if s[_SECONDARY]:
            if p not in olds:
                olds[p] = s
            slots[p] = s[:_SECONDARY] + (False,)
            dropped.append(p)
    if dropped:
        tx.effects.append(DropSecondary(tuple(dropped)))


def with_secondary(tx: Txn) -> list[ParamId]:
    """The params with a secondary shard kept, in order (O(params): at the step only)."""
    slots = tx._slots
    return [p for p in range(len(tx.st.spec.params)) if slots[p][_SECONDARY]]


def refresh(tx: Txn, pids: tuple[ParamId, ...]) -> None:
    """Rewrite the full values of `pids` (all AVAILABLE, sorted) from their shards in place: one
    gather, waited (effects.Refresh). They stay AVAILABLE and live; each is gathered anew for no
    trace step (-1), and is in `gathered` for the next sweep."""
    if not pids:
        return
    slots, olds = tx._slots, tx._olds
    for p in pids:
        s = slots[p]
        if p not in olds:
            olds[p] = s
        slots[p] = (AVAILABLE, None, s[_USERS], -1, s[_EXTERNAL], s[_SECONDARY])
    tx.gathered = tx.gathered.extend(pids)
    tx.effects.append(Refresh(pids))


def _unit(own: tuple[ParamId, ...], externals: tuple[ParamId, ...]) -> tuple[ParamId, ...]:
    """A fetch unit: a module's own params plus the external ones registered on it, sorted."""
    return own if not externals else tuple(sorted(set(own).union(externals)))


def unit_params(tx: Txn, module: ModuleId) -> tuple[ParamId, ...]:
    """The params a fetch of `module` needs: its own plus the external ones registered on it."""
    return _unit(tx.st.spec.modules[module].params, tx._mods[module][_EXTERNALS])


def unit_of(st: ParamState, module: ModuleId) -> tuple[ParamId, ...]:
    """`unit_params` read off a state (for checks and tests; starts no edit)."""
    return _unit(st.spec.modules[module].params, st.module_rows[module][_EXTERNALS])
