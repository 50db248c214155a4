"""Liveness: what a COMPLETE trace says each fetch prefetches and each release keeps, predicted
from the rules in words by plain Python (of fz3.core it reads only Config and the effect
records), so a core that prefetches or keeps less than the rules say, or prefetches further,
fails the parameter machine. The rules are DeepSpeed's, but for the two bounds fz3 departs on
([Note: prefetch bounds] in fz3/core/param/fetch.py).

    pass start (trace COMPLETE)   queue = deque of (step, param, offset): the plan's steps in
                                  order, each step's unit sorted (DeepSpeed's __param_queue),
                                  offset = the elements of the entries before it
    fetch of plan step s          drop the entries of steps <= s; then, while the head starts
                                  less than prefetch_bucket_size elements past the first entry
                                  of step s + 1, look at the head:
                                    NOT_AVAILABLE, not chosen yet, fits the live budget -> take it
                                    NOT_AVAILABLE, not chosen yet, does not fit         -> stop
                                    anything else                                       -> skip it
    last close of a module        candidates (AVAILABLE, no other user, not persistent, not
    fetched at plan step s        external) are kept if reused soon after s or prefetched for a
                                  step after s (see [Note: fetch marks] The rule in words keeps a candidate "prefetched for a step still to come".
The core marks each resident param with the latest step it was fetched *or* prefetched for
(ParamSlot.fetched_for); a child fetched while its parent is open, sharing a param with it (a
tied weight), lifts the mark past the parent's step. The core once compared the mark with the
releasing module's fetch step, so the parent's release kept the param although that later use
was over, whatever max_reuse_distance said (found by this check; fixed in
fz3/core/param/release.py). DeepSpeed and now the core compare it with the step of the latest fetch
(__step_id at the release), as this model does; it marks prefetches only, which gives the same
keeps.
"""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Mapping, Sequence

from fz3.config.config import Config
from fz3.core.effects import AllGather, Free

if TYPE_CHECKING:
    from fz3.core.param.state import ParamState

Queue = deque  # deque[tuple[int, int, int]]: (step, param, offset), plan order


def plan_queue(units: Sequence[frozenset[int]], numel: Sequence[int]) -> tuple[Queue, list[int]]:
    """A pass's prefetch queue: every (step, param) of the plan, step by step, params sorted, each
    with its offset (the numel of the entries before it); and the offset where each step starts
    (one more at the end)."""
    queue, starts, offset = deque(), [], 0
    for s, unit in enumerate(units):
        starts.append(offset)
        for p in sorted(unit):
            queue.append((s, p, offset))
            offset += numel[p]
    starts.append(offset)
    return queue, starts


def prefetch(queue: Queue, step: int, *, starts: Sequence[int], not_available: set[int],
             numel: Sequence[int], live: int, config: Config) -> dict[int, int]:
    """Pop `queue` as the prefetch after the fetch of plan step `step` walks it; -> {param: the
    step it is prefetched for}. `starts`: each step's first offset. `live`: numel gathered or in
    flight once this fetch's own gather is out.

    The reach: entries starting less than prefetch_bucket_size elements past step + 1's start
    (the last one may overshoot it); DeepSpeed instead takes up to the bucket more at every fetch.
    The walk stops *before* a param that would lift live numel past max_live_parameters (it
    stays at the head for the next fetch); DeepSpeed may overshoot the budget by one param. Both
    are fz3's documented departures, [Note: prefetch bounds] in fz3/core/param/fetch.py."""
    while queue and queue[0][0] <= step:
        queue.popleft()
    chosen: dict[int, int] = {}
    batch = 0
    end = starts[step + 1] + config.prefetch_bucket_size
    while queue and queue[0][2] < end:
        t, p, _ = queue[0]
        if p in not_available and p not in chosen:
            if live + batch + numel[p] > config.max_live_parameters:
                break
            chosen[p] = t
            batch += numel[p]
        queue.popleft()
    return chosen


def reused_soon(p: int, step: int, units: Sequence[frozenset[int]], step_numel: Sequence[int],
                distance: int) -> bool:
    """`p`'s next use in the plan after `step` is at a step t, and the modules strictly between
    hold fewer than `distance` elements in all (DeepSpeed's __params_to_release walk: add each
    module's numel, stop once the sum reaches max_reuse_distance)."""
    between = 0
    for t in range(step + 1, len(units)):
        if p in units[t]:
            return between < distance
        between += step_numel[t]
    return False


def keep(candidates: set[int], step: int, *, now: int, units: Sequence[frozenset[int]],
         step_numel: Sequence[int], fetched_for: Mapping[int, int], numel: Sequence[int],
         live: int, config: Config) -> set[int]:
    """The candidates a release of the module fetched at plan step `step` keeps: reused soon,
    or their resident copy was prefetched (`fetched_for`) for a step after `now`, the latest
    fetch's ([Note: fetch marks]); none at all if
    keeping them would leave more than max_live_parameters live once the rest are freed.

    The budget is fz3's documented departure (fz3/core/param/release.py, `release`): DeepSpeed's
    reuse-keeping ignores max_live_parameters."""
    kept = {p for p in candidates
            if fetched_for.get(p, -1) > now
            or reused_soon(p, step, units, step_numel, config.max_reuse_distance)}
    freed = sum(numel[p] for p in candidates - kept)
    return kept if live - freed <= config.max_live_parameters else set()


class Liveness:
    """The pass state the rules read (queue, each resident param's fetched-for step, each
    module's fetch step) and what they require of the current event: the prefetch of a fetch,
    the Free of a release. naive_params.py feeds it; `check` holds the core's effects to it."""

    def __init__(self, numel: Sequence[int], config: Config) -> None:
        self.numel, self.config = numel, config
        self.queue: Queue = deque()
        self.starts: list[int] = []  # the plan's offset where each step starts (plan_queue)
        # resident param -> the latest step it was prefetched for in this pass ([Note: fetch
        # marks]); dropped when it is freed
        self.fetched_for: dict[int, int] = {}
        self.fetch_step: dict[int, int] = {}  # module -> step of its latest fetch in this pass
        self.event, self.step = "", -1  # the current event, for messages; the latest fetch's step
        self.want_prefetch: dict[int, int] | None = None  # this event's, once predicted
        self.prefetch_due = False  # a COMPLETE fetch: predict at its prefetch point
        self.want_free: set[int] | None = None
        self.kept: set[int] = set()

    def start_pass(self, complete: bool, units: Sequence[frozenset[int]]) -> None:
        """A reset: a new queue from the plan (DeepSpeed rebuilds __param_queue each step), and
        the prefetched-for marks go (DeepSpeed: __most_recent_step_id_param_fetched_for)."""
        self.queue, self.starts = plan_queue(units, self.numel) if complete else (deque(), [])
        self.fetched_for, self.fetch_step = {}, {}

    def begin(self, ev, fetching: bool, releasing: bool) -> None:
        m = getattr(ev, "module", None)
        self.event = ev.kind if m is None else f"{ev.kind} of m{m}"
        self.want_prefetch = {} if fetching else None
        self.prefetch_due = False
        self.want_free = set() if releasing else None
        self.kept = set()

    def fetched(self, m: int, step: int, complete: bool, unit: set[int]) -> None:
        """`m` was fetched at `step` of this pass: its whole unit is resident (or in flight)."""
        self.fetch_step[m] = self.step = step
        self.prefetch_due = complete and self.config.prefetch_bucket_size > 0

    def predict_prefetch(self, not_available: set[int], live: int) -> None:
        """At the fetch's prefetch point (its own gather out): walk the queue once."""
        if not self.prefetch_due:
            return
        self.prefetch_due = False
        self.want_prefetch = prefetch(self.queue, self.step, starts=self.starts,
                                      not_available=not_available, numel=self.numel, live=live,
                                      config=self.config)
        self.fetched_for.update(self.want_prefetch)

    def released(self, m: int, candidates: set[int], live: int, plan: list[int] | None,
                 units: Sequence[frozenset[int]], step_numel: Sequence[int]) -> None:
        """The last open call of `m` closed: the Free the rules require."""
        s = self.fetch_step.get(m, -1)
        if plan is not None and candidates and 0 <= s < len(plan) and plan[s] == m:
            self.kept = keep(candidates, s, now=self.step, units=units, step_numel=step_numel,
                             fetched_for=self.fetched_for, numel=self.numel, live=live,
                             config=self.config)
        self.want_free = candidates - self.kept

    def freed(self, params: Sequence[int]) -> None:
        for p in params:
            self.fetched_for.pop(p, None)

    def check(self, effects: tuple, st: "ParamState") -> None:
        """The core's effects for this event are the ones the rules require (after the safety
        checks and the field-by-field agreement: this names what the core left undone)."""
        if self.want_prefetch is not None:
            got = [list(e.params) for e in effects if isinstance(e, AllGather) and e.prefetch]
            want = sorted(self.want_prefetch)
            assert got == ([want] if want else []), (
                f"liveness: {self.event} (step {self.step}) prefetched {got}; the rules prefetch "
                f"{want or 'nothing'}")
            for p, t in self.want_prefetch.items():
                core = st.params[p].fetched_for
                assert core == t, f"liveness: p{p} prefetched for step {t}, the core says {core}"
        if self.want_free is not None:
            got = [list(e.params) for e in effects if isinstance(e, Free)]
            want = sorted(self.want_free)
            assert got == ([want] if want else []), (
                f"liveness: {self.event} freed {got}; the rules free {want or 'nothing'} and keep "
                f"{sorted(self.kept)}")
