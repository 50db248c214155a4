"""The steady state replayed: a pass recorded once, later passes answered from the recording.

    advance(replay, event, *, config) -> (replay, effects)    the engine's door to the core

              pass starts (root Enter)
                    |
       +------------+--------------------------------------------+
       | a kept schedule starts from this state (up to `Shift`)  | none
       | with this event                                         |
       v                                                         v
    PLAYING: each event is checked to be the one the      FULL: `events.update`, as always;
    schedule expects, and its effects and state are       a pass whose trace is COMPLETE is
    read off the schedule: a compare and a lookup         RECORDING: its events, states and
       |                                                  effects kept, a Schedule at its end
       | an event it does not expect (a departure)
       v
    the state the schedule says the run is in is made real, and `events.update` takes the
    event: exactly what would have happened without the schedule (re-record, invalidate, the
    divergence check: all of it runs as it always does)

A pass is everything from a root Enter to the next: its forward, backward and step. In a steady
state every pass of one kind is the same: the same events, from the same state, so (the core
being pure and deterministic) the same effects and states follow. The schedule of a pass is
that list, computed once by `events.update` and then read. A played schedule that ends where
another starts is linked to it, so a steady run goes from schedule to schedule with no state
built at all; the state is made only when something reads it (`current`) or the run departs.

[Note: a pass forgets] The state a pass starts from must be the same every step for its
schedule to apply again, and the core's state counts: backwards, accumulation windows, gather
handles, bucket ids, and per param the backward and window of its last report and write. So at
each pass's start the core forgets what no later transition can read: gather handles and bucket
ids restart at 0 once none is in flight or open (fz3/core/param/step.py reset_step,
fz3/core/grad/grads.py new_pass), a param record's fields that no longer equal their counter
become NEVER (grads.new_pass), and the shell numbers autograd's graph tasks from 0 in each pass
(torch's own ids grow for the whole process). What is left to differ between two steady passes
is two counters, `backward` and `window`, and the per-param fields that equal them: a `Shift`
moves all of those together. The core compares those fields only with their counters, for
equality, so a shifted state behaves as the state did (tests/test_replay.py checks `events.update`
against shifted states), and a schedule recorded at one step serves every later one: its
states shifted by how far the counters moved. The one effect that carries a counter, SkipStep
(the step number it skipped), and the one event that sets counters, Resumed (a checkpoint
loaded), are never kept in a schedule.

[Note: schedules keep their own lineage] A PVec's old version reaches every later version's
diffs (pvec.py), so a schedule, which keeps the states of its pass, must never share a lineage
with the run that goes on: every state the run continues from after a schedule (the end of a
recording, a departure, the end of a play that links nowhere) is a fresh copy (`_own`). A
schedule then keeps its own pass's changes and nothing more (tests/test_state_history.py).

DeepSpeed replays nothing: its trace gives the prefetch order, and every hook runs its full
Python; torch.compile'd FSDP2 / SimpleFSDP trace the step into a graph instead (docs/compile.md).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

from fz3.config.config import Config
from fz3.core import events
from fz3.core.calls import Lifecycle
from fz3.core.effects import record
from fz3.core.events import Enter, Resumed
from fz3.core.grad.grads import NEVER, GradState
from fz3.core.hook_effects import SkipStep
from fz3.core.ids import TraceMode
from fz3.core.param.state import copied
from fz3.core.pvec import Log, PVec

KEEP = 8  # schedules kept (train and eval kinds, each micro-step of a window); the oldest goes
WASTED = 4  # recordings in a row never played: record only every RETRY-th pass after that
RETRY = 32


@record
class Shift(NamedTuple):
    """How far the two counters moved: backwards run, accumulation windows closed."""

    backward: int = 0
    window: int = 0

    def __add__(self, other: "Shift") -> "Shift":  # type: ignore[override]
        return Shift(self.backward + other.backward, self.window + other.window)

    def __sub__(self, other: "Shift") -> "Shift":
        return Shift(self.backward - other.backward, self.window - other.window)


NO_SHIFT = Shift()


class Schedule(NamedTuple):
    """One pass as `events.update` ran it."""

    id: int  # unique in its Replay (links name schedules by id)
    before: Lifecycle  # the state the pass started from: its root Enter's input
    events: tuple  # the pass's events, its root Enter first
    after: tuple[Lifecycle, ...]  # the state after each event
    effects: tuple[tuple, ...]  # each event's effects


class Playing(NamedTuple):
    schedule: Schedule
    at: int  # events of it taken so far (>= 1)
    shift: Shift  # the run's counters are the schedule's moved by this


class Recording(NamedTuple):
    before: Lifecycle
    events: Log
    after: Log
    effects: Log


class Link(NamedTuple):
    """A play of `start`'s schedule to its end left the state `end`'s starts from, moved by
    `shift`: `end.before == shifted(start.after[-1], shift)`."""

    start: int
    end: int
    shift: Shift


class Replay(NamedTuple):
    """The engine's cell: the core's state, and what it knows of the passes it has seen."""

    state: Optional[Lifecycle]  # the state when not playing (None while playing: `current`)
    playing: Optional[Playing]
    recording: Optional[Recording]
    schedules: tuple[Schedule, ...]  # newest last, at most KEEP
    links: tuple[Link, ...]
    last: Optional[tuple[int, Shift]]  # the schedule the pass that just ended played (or was
    # recorded as) to its end, and its shift: where a link from it would start
    next_id: int = 0
    passes: int = 0  # passes started
    replayed: int = 0  # events answered from a schedule
    wasted: int = 0  # recordings closed since a schedule last played


def start(state: Lifecycle) -> Replay:
    return Replay(state, None, None, (), (), None)


# ---- reading the state ------------------------------------------------------------------------

def view(rp: Replay) -> Lifecycle:
    """The state as the schedule holds it: exact but for the two counters (`Shift`), which it
    has as they were when the schedule was recorded. Relations inside it hold (a param's
    `got == window`), so a reader that needs no absolute count may use it; O(1)."""
    if rp.playing is None:
        return rp.state
    pl = rp.playing
    return pl.schedule.after[pl.at - 1]


def shift_of(rp: Replay) -> Shift:
    """What `view`'s counters lack: 0 unless playing."""
    return NO_SHIFT if rp.playing is None else rp.playing.shift


def current(rp: Replay) -> Lifecycle:
    """The state, exact: `view` with its counters shifted; O(params) while playing."""
    if rp.playing is None:
        return rp.state
    return shifted(view(rp), rp.playing.shift)


def shifted(st: Lifecycle, d: Shift) -> Lifecycle:
    """`st` with the backward and window counters moved by `d`, and every per-param field that
    holds one of them ([Note: a pass forgets]); in a lineage of its own (`_own`)."""
    g = st.grads
    rows = g.params.current()
    if d != NO_SHIFT:
        b, w = d.backward, d.window
        rows = [pg if pg.reported == NEVER and pg.written == NEVER and pg.got == NEVER and pg.waits == NEVER else
                pg._replace(reported=pg.reported + b if pg.reported != NEVER else NEVER,
                            written=pg.written + w if pg.written != NEVER else NEVER,
                            got=pg.got + w if pg.got != NEVER else NEVER,
                            waits=pg.waits + w if pg.waits != NEVER else NEVER) for pg in rows]
        g = g._replace(backward=g.backward + b, window=g.window + w)
    return Lifecycle(copied(st.params), g._replace(params=PVec(rows)), st.calls)


def _own(st: Lifecycle) -> Lifecycle:
    """`st` in fresh PVecs ([Note: schedules keep their own lineage])."""
    return shifted(st, NO_SHIFT)


# ---- the door -------------------------------------------------------------------------------

def starts_pass(event) -> bool:
    return type(event) is Enter and event.module == 0 and not event.recomputing


def advance(rp: Replay, event, *, config: Config, check: bool = False, keep: bool = True) -> tuple[Replay, tuple]:
    """The state after `event`, and the effects to run for it: `events.update`'s, read off a
    schedule when one applies (see the module docstring). `check`: also run `events.update` on
    every event a schedule answers and fail if it gives other effects or another state
    (Options.debug_checks). `keep` False: record nothing, so every event takes the full
    transition (Options.replay)."""
    pl = rp.playing
    if pl is not None:
        sch, at = pl.schedule, pl.at
        if at < len(sch.events):
            if event == sch.events[at]:
                if check:
                    _check(rp, event, sch.after[at], sch.effects[at], pl.shift, config)
                return Replay(None, Playing(sch, at + 1, pl.shift), None, rp.schedules, rp.links, None,
                              rp.next_id, rp.passes, rp.replayed, rp.wasted), sch.effects[at]
        elif starts_pass(event):
            rp = rp._replace(replayed=rp.replayed + len(sch.events), last=(sch.id, pl.shift))
            for link in rp.links:
                if link.start == sch.id:
                    nxt = _schedule(rp, link.end)
                    if nxt is not None and nxt.events[0] == event:
                        return _play(rp, nxt, pl.shift + link.shift, event, config, check)
            return _full(rp._replace(state=current(rp), playing=None), event, config, check, keep)
        # a departure: the run goes on from the state the schedule had it in
        rp = rp._replace(state=current(rp), playing=None, replayed=rp.replayed + at, last=None)
    return _full(rp, event, config, check, keep)


def _full(rp: Replay, event, config: Config, check: bool, keep: bool) -> tuple[Replay, tuple]:
    """`events.update` on the real state; a pass start first closes the recording and looks
    for a schedule that applies."""
    st = rp.state
    if starts_pass(event):
        rp, st = _close(rp, st)
        for sch in reversed(rp.schedules):
            d = _applies(sch, st, event)
            if d is not None:
                if rp.last is not None:  # a link from the pass that just ended
                    start_id, start_shift = rp.last
                    rp = rp._replace(links=rp.links + (Link(start_id, sch.id, d - start_shift),))
                return _play(rp, sch, d, event, config, check)
        rp = rp._replace(last=None, passes=rp.passes + 1)
    new, effects = events.update(st, event, config=config)
    rec = rp.recording
    if rec is not None:
        rec = Recording(rec.before, rec.events.extend((event,)), rec.after.extend((new,)),
                        rec.effects.extend((effects,)))
    elif keep and starts_pass(event) and _worth_recording(rp, st, new):
        rec = Recording(st, Log((event,)), Log((new,)), Log((effects,)))
    return rp._replace(state=new, recording=rec), effects


def _play(rp: Replay, sch: Schedule, d: Shift, event, config: Config, check: bool) -> tuple[Replay, tuple]:
    if check:
        _check(rp._replace(state=shifted(sch.before, d), playing=None), event, sch.after[0], sch.effects[0], d, config)
    return (Replay(None, Playing(sch, 1, d), None, rp.schedules, rp.links, None, rp.next_id,
                   rp.passes + 1, rp.replayed, 0), sch.effects[0])


def _applies(sch: Schedule, st: Lifecycle, event) -> Optional[Shift]:
    """The shift under which `sch` starts from `st` with `event`, or None. O(params)."""
    before = sch.before
    if sch.events[0] != event or before.grads.micro_step != st.grads.micro_step:
        return None
    d = Shift(st.grads.backward - before.grads.backward, st.grads.window - before.grads.window)
    return d if shifted(before, d) == st else None


def _close(rp: Replay, st: Lifecycle) -> tuple[Replay, Lifecycle]:
    """The pass that ends here was recording: keep it (unless it holds what a shift cannot
    move), and go on in a lineage of the run's own. -> (replay, the state to go on from)."""
    rec = rp.recording
    if rec is None:
        return rp, st
    st = _own(st)
    rp = rp._replace(state=st, recording=None)
    evs, effs = tuple(rec.events), tuple(rec.effects)
    if any(type(e) is Resumed for e in evs) or any(type(x) is SkipStep for eff in effs for x in eff):
        return rp._replace(last=None), st
    sch = Schedule(rp.next_id, rec.before, evs, tuple(rec.after), effs)
    kept = rp.schedules[-(KEEP - 1):] + (sch,)
    ids = {s.id for s in kept}
    links = tuple(link for link in rp.links if link.start in ids and link.end in ids)
    return rp._replace(schedules=kept, links=links, last=(sch.id, NO_SHIFT), next_id=rp.next_id + 1,
                       wasted=rp.wasted + 1), st


def _worth_recording(rp: Replay, before: Lifecycle, new: Lifecycle) -> bool:
    """A pass on a COMPLETE trace (its prefetch decided by the plan, as every later pass of its
    kind will be) that also starts where a pass on a COMPLETE trace ended: the first pass after
    the recording one starts from a state holding that recording, which no later pass does, so
    its schedule would never play and only take memory. After WASTED recordings in a row that
    never played, one pass in RETRY."""
    if new.params.trace.mode is not TraceMode.COMPLETE or before.params.trace.mode is not TraceMode.COMPLETE:
        return False
    return rp.wasted < WASTED or rp.passes % RETRY == 0


def _schedule(rp: Replay, sid: int) -> Optional[Schedule]:
    for sch in rp.schedules:
        if sch.id == sid:
            return sch
    return None


def _check(rp: Replay, event, after: Lifecycle, effects: tuple, d: Shift, config: Config) -> None:
    """Options.debug_checks: the schedule's answer is `events.update`'s."""
    want, want_effects = events.update(current(rp), event, config=config)
    assert want_effects == effects, (
        f"fz3 replay: {event!r} was answered with {effects}, update gives {want_effects}")
    assert shifted(after, d) == want, f"fz3 replay: {event!r} left another state than update does"

