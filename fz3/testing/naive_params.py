"""A deliberately naive model of the parameter lifecycle, held against the core by the machines.

Plain dicts, sets and lists; no persistent vectors, no cons lists, no cursors. It does three jobs:

  interpreter  executes the core's effects (AllGather / Wait / Free) the way the real one would,
               and refuses the illegal ones: a gather of a param that is not NOT_AVAILABLE, a
               wait of a handle not in flight, a free of a param that is in flight, not
               gathered, used by an active module or held, a prefetch off the plan or over
               budget
  bookkeeper   derives from the shell's events alone what the core must believe: which modules
               are active, the backward counters, the externals, the holds of
               gathered_parameters, the trace (mode, plan, invalidations) -- so `agree(state)`
               can compare field by field
  rules        feeds naive_rules.py (`self.rules`), which predicts what a COMPLETE trace's
               prefetch and reuse-keeping must do; `rules.check` holds the core to it (liveness)

Every check raises AssertionError with a message naming the param, module or handle.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable, Sequence

from fz3.config.config import Config
from fz3.core.effects import AllGather, DropSecondary, Free, Refresh, Wait
from fz3.core.ids import Status, TraceMode
from fz3.core.spec import ModelSpec
from fz3.testing.coverage import covered
from fz3.testing.naive_rules import Liveness

NA, INFLIGHT, AV = Status.NOT_AVAILABLE, Status.INFLIGHT, Status.AVAILABLE
FETCHING = ("fetch", "pre_backward")
SWEEPS = ("reset", "finish", "end_of_step")


class NaiveTrace:
    """The trace as the design states it: the whole fetch order of each pass, kept as a list."""

    def __init__(self) -> None:
        self.mode, self.plan, self.this_pass, self.invalidations = TraceMode.INVALID, None, [], 0
        self.units: list[frozenset[int]] = []  # the plan's fetch units, as at its freeze
        self.step_numel: list[int] = []

    def _invalidate(self) -> None:
        self.mode, self.plan, self.invalidations = TraceMode.INVALID, None, self.invalidations + 1

    def fetch(self, m: int) -> None:
        s = len(self.this_pass)
        if self.mode is TraceMode.COMPLETE and (s >= len(self.plan) or self.plan[s] != m):
            self._invalidate()
        self.this_pass.append(m)

    def units_changed(self) -> None:
        if self.mode is TraceMode.COMPLETE:
            self._invalidate()

    def reset(self, aborted: bool = False, unit: Callable[[int], set[int]] | None = None,
              numel: Sequence[int] = ()) -> None:
        if aborted:  # a pass that raised is forgotten: neither recorded nor a departure
            self.mode = TraceMode.RECORD if self.mode is TraceMode.INVALID else self.mode
            self.this_pass = []
            return
        if self.mode is TraceMode.COMPLETE and len(self.this_pass) not in (0, len(self.plan)):
            self._invalidate()  # the pass ended before its plan did
        if self.mode is TraceMode.INVALID:
            self.mode = TraceMode.RECORD
        elif self.mode is TraceMode.RECORD and self.this_pass:
            self.mode, self.plan = TraceMode.COMPLETE, list(self.this_pass)
            self.units = [frozenset(unit(m)) for m in self.plan]
            self.step_numel = [sum(numel[p] for p in u) for u in self.units]
        self.this_pass = []


class NaiveParams:
    def __init__(self, spec: ModelSpec, config: Config) -> None:
        self.config = config
        self.numel = [p.numel for p in spec.params]
        self.persistent = {p for p, n in enumerate(self.numel) if n <= config.param_persistence_threshold}
        self.own = [set(m.params) for m in spec.modules]
        self.status = {p: NA for p in range(len(self.numel))}
        self.handle: dict[int, int] = {}  # param -> handle while INFLIGHT
        self.outstanding: dict[int, tuple[int, ...]] = {}  # handle -> params, issue order
        self.issued: set[int] = set()
        self.live = 0
        self.active: Counter[int] = Counter()  # module -> open calls (fetched, not released); > 0 only
        self.externals: dict[int, set[int]] = {m: set() for m in range(len(self.own))}
        self.pre = [0] * len(self.own)
        self.grads = [0] * len(self.own)
        self.trace = NaiveTrace()  # the trace of the current pass kind
        self.kind = "train"
        self.traces = {"train": self.trace}  # one per pass kind: grad enabled or not
        self.computed: list[tuple[int, frozenset[int]]] = []  # (module, its AVAILABLE params)
        self.pass_gathered: set[int] = set()
        self.pass_freed: set[int] = set()
        self.holds: Counter[int] = Counter()  # gathered_parameters: param -> open holds
        self.module: int | None = None  # the module the current event is about
        self.rules = Liveness(self.numel, config)  # what the trace's rules require (liveness)
        self.H = spec.secondary  # hpZ ([Note: hpZ], fz3/core/stage.py): 1 off
        self.secondary: set[int] = set()  # params whose secondary shard is kept

    # ---- derived views ---------------------------------------------------------------------------
    def unit(self, m: int) -> set[int]:
        return self.own[m] | self.externals[m]

    def in_use(self) -> set[int]:
        """Params an active module uses or a gathered_parameters holds: never to be freed."""
        out = {p for p, n in self.holds.items() if n}
        for a in self.active:
            out |= self.unit(a)
        return out

    def close(self, m: int) -> None:
        """One open call of `m` ends (a release, or a post_backward)."""
        if self.active[m] > 1:
            self.active[m] -= 1
        else:
            self.active.pop(m, None)

    def release(self, m: int) -> None:
        """Close one open call of `m`; at the last, the rules say which of its params go."""
        last = self.active[m] == 1
        self.close(m)
        if not last:
            return
        used, sticky = self.in_use(), self.persistent | self.external()
        candidates = {p for p in self.unit(m) if self.status[p] is AV and p not in used and p not in sticky}
        tr = self.trace
        self.rules.released(m, candidates, self.live, tr.plan if tr.mode is TraceMode.COMPLETE else None,
                            tr.units, tr.step_numel)

    def not_available(self) -> set[int]:
        return {p for p, s in self.status.items() if s is NA}

    def exempt(self) -> set[int]:
        """Params the live budget does not cover: in use, persistent, external."""
        return self.in_use() | self.persistent | self.external()

    def external(self) -> set[int]:
        return {p for ps in self.externals.values() for p in ps}

    # ---- events ----------------------------------------------------------------------------------
    def on_event(self, ev, effects: tuple) -> None:
        """Apply the event record `ev` (fz3/testing/param_events.py), execute the core's
        `effects` for it, check the outcome."""
        kind = ev.kind
        m = self.module = getattr(ev, "module", None)
        self.ev = ev
        fetching = kind == "fetch"
        self.rules.begin(ev, fetching=kind == "fetch" or (kind == "pre_backward" and self.pre[m] > 0),
                         releasing=kind in ("release", "post_backward"))
        if kind == "release" and ev.grad_outputs:
            self.pre[m] += 1  # grad wrapping, folded into fetch / release as the shell reports it
        if kind == "fetch":
            self.grads[m] += ev.grad_inputs
        if kind == "pre_backward" and self.pre[m] > 0:
            self.pre[m] -= 1
            fetching = True
        elif kind == "release":
            self.release(m)
        elif kind == "post_backward" and self.grads[m] > 0:
            self.grads[m] -= 1
            self.release(m)  # one call's backward is done
        elif kind == "external":  # the core may sweep (invalidation) before the unit grows
            new = set(ev.params) - self.unit(m)
            if new:
                self.trace.units_changed()
        elif kind in ("reset", "finish"):
            self.active.clear()
            self.pre, self.grads = [0] * len(self.own), [0] * len(self.own)
        elif kind == "hold":
            self.holds.update(ev.params)
        elif kind == "unhold":
            self.holds.subtract(ev.params)
            sticky, used = self.persistent | self.external(), self.in_use()
            self.expect_free = {p for p in ev.params if p not in used and self.status[p] is AV
                                and (ev.stale or p not in sticky)}
        if fetching:
            self.trace.fetch(m)
            self.rules.fetched(m, len(self.trace.this_pass) - 1, self.trace.mode is TraceMode.COMPLETE,
                               self.unit(m))
        elif kind in FETCHING:
            assert not effects, f"pre_backward of m{m} with no forward call left emitted {effects}"
        self.refreshed: set[int] = set()
        for e in effects:
            if isinstance(e, AllGather) and e.prefetch:  # the prefetch point: the rules walk here
                self.rules.predict_prefetch(self.not_available(), self.live)
            self._execute(e, kind)
        if fetching:  # no prefetch emitted: what would the rules have taken?
            self.rules.predict_prefetch(self.not_available(), self.live)
        if kind == "external":
            self.externals[m] |= new
        if kind == "reset":
            grad, aborted = ev.grad_enabled, ev.aborted
            self.trace.reset(aborted, self.unit, self.numel)
            self.kind = "train" if grad else "train_no_grad"
            if self.kind not in self.traces:
                self.traces[self.kind] = NaiveTrace()
                self.traces[self.kind].reset()
            self.trace = self.traces[self.kind]
            self.pass_gathered, self.pass_freed = set(), set()
            self.issued = set()  # nothing is in flight (the sweep): a pass's handles may count from 0
            self.rules.start_pass(self.trace.mode is TraceMode.COMPLETE, self.trace.units)
        self._after(kind, m, fetching, effects)

    def _after(self, kind: str, m: int | None, fetching: bool, effects: tuple) -> None:
        if fetching:
            self.active[m] += 1
            if any(isinstance(e, AllGather) and e.prefetch for e in effects):
                assert self.live <= self.config.max_live_parameters, (  # I1
                    f"prefetch in the fetch of m{m} left {self.live} live > max_live_parameters")
        if kind == "compute":
            self.compute(m)
        for a in sorted(self.active):  # an active module may compute at any moment
            bad = sorted(p for p in self.unit(a) if self.status[p] is not AV)
            assert not bad, f"active module m{a} would compute with params {bad}, not AVAILABLE"
        if kind == "hold":
            assert all(self.status[p] is AV for p in self.ev.params), "held params not AVAILABLE"
        if kind == "unhold":
            freed = {p for e in effects if isinstance(e, Free) for p in e.params}
            assert freed == self.expect_free, f"unhold freed {sorted(freed)}, not {sorted(self.expect_free)}"
        exempt = self.exempt()
        extra = sum(self.numel[p] for p, s in self.status.items() if s is not NA and p not in exempt)
        assert extra <= self.config.max_live_parameters, (  # I1, at all times
            f"{extra} live elements beyond active/persistent/external > max_live_parameters")
        if kind in SWEEPS:
            assert not self.outstanding, f"handles {list(self.outstanding)} left in flight after {kind}"
            held = {p for p, n in self.holds.items() if n}
            keep = self.persistent | held if kind == "end_of_step" else self.exempt()
            assert all(self.status[p] is AV for p in held), f"held params freed by {kind}"
            left = sorted(p for p, s in self.status.items() if s is not NA and p not in keep)
            assert not left, f"params {left} still gathered after {kind}"
        if kind == "end_of_step":  # the shards changed: every full value left is a fresh one
            stale = sorted(p for p, s in self.status.items() if s is AV and p not in self.refreshed)
            assert not stale, f"params {stale} stay gathered after end_of_step, not refreshed"
            assert not self.secondary, f"params {sorted(self.secondary)} keep stale secondary shards past the step"
        if kind == "unhold" and self.ev.stale:
            kept = sorted(self.secondary & set(self.ev.params))
            assert not kept, f"params {kept} keep secondary shards past a stale gathered_parameters"
        if kind == "finish":  # nothing gathered in the pass leaks past it
            leaked = self.pass_gathered - self.pass_freed - self.exempt()
            assert not leaked, f"params {sorted(leaked)} gathered in the pass and never freed"

    def compute(self, m: int) -> None:
        """Module `m` computes: record what it finds AVAILABLE; I5 says always its whole unit."""
        assert m in self.active, f"m{m} computes outside fetch..release"
        have = frozenset(p for p in self.unit(m) if self.status[p] is AV)
        self.computed.append((m, have))
        assert have == self.unit(m), f"m{m} computes without params {sorted(self.unit(m) - have)}"

    # ---- effects ---------------------------------------------------------------------------------
    def _execute(self, e: object, kind: str) -> None:
        if isinstance(e, AllGather):
            self._gather(e, kind)
        elif isinstance(e, Wait):
            assert e.handle in self.outstanding, f"Wait({e.handle}) for a handle not in flight"
            for p in self.outstanding.pop(e.handle):
                self.status[p] = AV
                del self.handle[p]
        elif isinstance(e, Free):
            self._free(e, kind)
        elif isinstance(e, Refresh):
            self._refresh(e, kind)
        elif isinstance(e, DropSecondary):
            self._drop_secondary(e, kind)
        else:
            raise AssertionError(f"unexpected effect {e!r} during {kind}")

    def _gather(self, e: AllGather, kind: str) -> None:
        ps = e.params
        assert ps and list(ps) == sorted(set(ps)), f"{e}: params must be non-empty, sorted, unique"
        assert e.handle not in self.issued, f"{e}: handle reused within a pass"
        for p in ps:
            assert self.status[p] is NA, f"{e}: p{p} is already {self.status[p].name}"
        m, tr = self.module, self.trace
        if e.prefetch:
            assert kind in FETCHING and tr.mode is TraceMode.COMPLETE, f"{e} outside a COMPLETE fetch"
            ahead = set().union(*(self.unit(x) for x in tr.plan[len(tr.this_pass):]))
            assert set(ps) <= ahead, f"{e}: prefetches {sorted(set(ps) - ahead)}, not ahead in the plan"
            n = [self.numel[p] for p in ps]
            assert sum(n) - max(n) < self.config.prefetch_bucket_size, f"{e} overfills the bucket"
        elif kind in FETCHING:
            assert set(ps) <= self.unit(m), f"{e}: gathers params m{m} does not use"
        elif kind == "external":
            assert set(ps) <= set(self.ev.params) - self.unit(m), f"{e}: gathers params not newly external"
        elif kind == "hold":
            assert set(ps) <= set(self.ev.params), f"{e}: gathers params not held"
        else:
            again = self.persistent | {p for p, n in self.holds.items() if n}
            assert kind == "end_of_step" and set(ps) <= again, f"{e} during {kind}"
        # hpZ: the backward gathers from a secondary shard whatever has one (the forward never does)
        want = tuple(p for p in ps if p in self.secondary) if self.H > 1 and kind == "pre_backward" else ()
        assert e.secondary == want, f"{e} during {kind}: the params to gather from secondary shards are {want}"
        if want:
            covered("hpZ", "the backward gathers from secondary shards")
        self.issued.add(e.handle)
        self.outstanding[e.handle] = ps
        for p in ps:
            self.status[p], self.handle[p] = INFLIGHT, e.handle
            self.live += self.numel[p]
        self.pass_gathered |= set(ps)
        assert len(self.outstanding) <= self.config.max_ongoing_fetch_events, (
            f"{len(self.outstanding)} gathers in flight, past max_ongoing_fetch_events "
            f"{self.config.max_ongoing_fetch_events}")

    def _refresh(self, e: Refresh, kind: str) -> None:
        """The step gathers its persistent and held params again where they lie: they stay
        AVAILABLE, and nothing else is refreshed."""
        ps = e.params
        assert ps and list(ps) == sorted(set(ps)), f"{e}: params must be non-empty, sorted, unique"
        again = self.persistent | {p for p, n in self.holds.items() if n}
        assert kind == "end_of_step" and set(ps) <= again, f"{e} during {kind}: only the step refreshes ({sorted(again)})"
        for p in ps:
            assert self.status[p] is AV, f"{e}: p{p} is {self.status[p].name}, not AVAILABLE"
        self.refreshed |= set(ps)

    def _drop_secondary(self, e: DropSecondary, kind: str) -> None:
        """hpZ: the step drops every secondary shard; a stale gathered_parameters those it held."""
        ps = set(e.params)
        assert e.params and list(e.params) == sorted(ps), f"{e}: params must be non-empty, sorted, unique"
        if kind == "end_of_step":
            assert ps == self.secondary, f"{e}: the step must drop every secondary shard {sorted(self.secondary)}"
        else:
            assert kind == "unhold" and self.ev.stale, f"{e} during {kind}: only the step or a stale unhold drops"
            want = self.secondary & set(self.ev.params)
            assert ps == want, f"{e}: a stale unhold drops the secondary shards of what it held, {sorted(want)}"
        self.secondary -= ps
        covered("hpZ", f"secondary shards dropped at {kind}")

    def _free(self, e: Free, kind: str) -> None:
        ps = e.params
        # hpZ: a release whose backward gathers them again keeps a secondary shard of each not kept yet
        want = tuple(p for p in ps if p not in self.secondary) if self.H > 1 and e.refetch else ()
        assert e.secondary == want, f"{e} during {kind}: the secondary shards to keep are {want}"
        if want:
            covered("hpZ", "a forward release keeps secondary shards")
        self.secondary |= set(want)
        assert ps and list(ps) == sorted(set(ps)), f"{e}: params must be non-empty, sorted, unique"
        used = set().union(*(self.unit(a) for a in self.active))
        sticky = self.persistent | self.external()
        for p in ps:
            assert self.status[p] is AV, f"{e}: p{p} is {self.status[p].name}"
            assert p not in used, f"{e}: p{p} is used by an active module ({sorted(self.active)})"
            assert kind == "end_of_step" or not self.holds[p], f"{e}: p{p} is held by gathered_parameters"
            assert kind == "end_of_step" or (kind == "unhold" and self.ev.stale) or p not in sticky, (
                f"{e}: p{p} is persistent/external")
            self.status[p] = NA
            self.live -= self.numel[p]
        self.pass_freed |= set(ps)
        self.rules.freed(ps)
        # refetch: the module releasing them has a backward fetch still to come in this pass, or
        # the step frees them to gather them again at once (persistent or held)
        if kind == "end_of_step":  # what stays is refreshed in place, not freed
            again = sorted(p for p in ps if p in self.persistent or self.holds[p] > 0)
            assert not again and not e.refetch, f"{e} during end_of_step frees {again}, which stay"
            return
        refetch = kind in ("release", "post_backward") and self.pre[self.module] > 0
        assert e.refetch == refetch, f"{e} during {kind} of m{self.module}: refetch should be {refetch}"

    # ---- agreement with the core -----------------------------------------------------------------
    def agree(self, st) -> None:
        """The core's state says what this model says, field by field."""
        for p, s in enumerate(st.params):
            users = sum(1 for a in self.active if p in self.unit(a)) + self.holds[p]
            assert s.status is self.status[p] and s.handle == self.handle.get(p), (
                f"p{p}: core {s.status.name}/{s.handle}, model {self.status[p].name}/{self.handle.get(p)}")
            assert s.users == users, f"p{p}: core counts {s.users} users, model {users}"
            assert s.external == (p in self.external()), f"p{p}: external flag {s.external}"
            assert s.secondary == (p in self.secondary), f"p{p}: core says secondary shard {s.secondary}"
        assert [(f.handle, f.params) for f in st.inflight] == list(self.outstanding.items()), (
            f"in flight: core {st.inflight}, model {self.outstanding}")
        assert st.live_numel == self.live, f"live numel: core {st.live_numel}, model {self.live}"
        assert list(st.held) == sorted(self.holds.elements()), f"held: core {st.held}, model {self.holds}"
        for m, ms in enumerate(st.modules):
            assert (ms.pre_backward, ms.grads_remaining) == (self.pre[m], self.grads[m]), (
                f"m{m} counters: core {ms.pre_backward}/{ms.grads_remaining}, "
                f"model {self.pre[m]}/{self.grads[m]}")
            assert ms.externals == tuple(sorted(self.externals[m])), f"m{m} externals {ms.externals}"
            assert ms.active == self.active[m], f"m{m}: core has {ms.active} open calls, model {self.active[m]}"
        tr, nt = st.trace, self.trace
        total = sum(t.invalidations for t in self.traces.values())
        assert (tr.mode, tr.invalidations, tr.step_id) == (nt.mode, total, len(nt.this_pass)), (
            f"trace: core {tr.mode.name}/{tr.invalidations}/{tr.step_id}, "
            f"model {nt.mode.name}/{total}/{len(nt.this_pass)}")
        assert tr.kind == self.kind, f"trace kind: core {tr.kind}, model {self.kind}"
        if nt.mode is TraceMode.COMPLETE:
            assert list(tr.plan.order) == nt.plan, f"plan: core {tr.plan.order}, model {nt.plan}"
