"""The trace: the recorded order of module fetches that drives prefetch and reuse-aware release.

    INVALID --reset--> RECORD --reset--> COMPLETE --reset (pass matched)--> COMPLETE
       ^                                     |
       +---- a fetch departs from the plan --+   (or a pass ends early: reset goes on to RECORD)

A pass is one forward (+ its backward); `reset` runs at the start of each pass. A RECORD pass
logs every fetch; the next reset freezes the log into a `TracePlan`: the module order, the param
queue prefetch walks, and, per step, which params are used again within `max_reuse_distance`.
Building the plan costs O(trace) once; each fetch after that costs O(its params).

[Note: one trace per pass kind] A training pass fetches every module in forward and again in
backward; an evaluation pass under no_grad fetches them in forward only. With one trace, each
switch between the two departs from the plan and records again, so a loop that evaluates every
few steps never prefetches (DeepSpeed issue #5662). The trace is kept per *pass kind* (grad
enabled or not, module.training or not, see `pass_kind`): a pass of another kind than the last
parks the current trace (closed, as a reset would) and takes up its own kind's, so alternating
train steps and evaluations keeps both plans COMPLETE. `invalidations` counts over all kinds.
Whether the root's inputs need grad is part of the kind too: a GAN's discriminator runs on
real images (no grad), on the generator's images detached, and on them with grad for the
generator's step; with grad inputs its first layer's backward ends at a PostBackward node,
without them at its params' grads, and the backward fetches in another order. One trace for
both would be dropped every pass (3 times in 3 iterations).

[Note: aborted passes] A forward that raised (a shape error in one block) ends mid-pass. Its
partial log is not the model's order: `reset(..., aborted=True)` drops it (RECORD records again,
a COMPLETE plan stays), so one exception neither freezes a wrong plan nor counts as a departure.

Pure bookkeeping on TraceState only: draining gathers and freeing wrong prefetches when a trace
is invalidated is done by `step.invalidate`, which owns the parameter state.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

from fz3.core.ids import ModuleId, ParamId, TraceMode
from fz3.core.pvec import Log


class TracePlan(NamedTuple):
    """A frozen recording. DeepSpeed: __submodule_order + __param_order, built by
    construct_parameter_trace_from_module_trace, plus __params_to_release's look-ahead."""

    order: tuple[ModuleId, ...]  # module fetched at each step
    queue: tuple[tuple[int, ParamId], ...]  # (step, param) in fetch order; one step's params sorted
    step_start: tuple[int, ...]  # queue index where step s starts; len(order) + 1 entries
    offsets: tuple[int, ...]  # offsets[i]: numel of queue entries before index i; len(queue) + 1
    # entries (a param used at two steps counts twice): how far ahead an entry lies, in elements
    reused: tuple[tuple[ParamId, ...], ...]  # per step: its params used again within the distance
    # (sorted tuples, not frozensets: tuples of ints leave CPython's GC, so a plan of a 10 000-
    # module model adds nothing for full collections to walk)


class TraceState(NamedTuple):
    mode: TraceMode
    step_id: int  # fetches so far in this pass
    recording: Log[ModuleId]  # this pass's fetches, in order
    plan: Optional[TracePlan]  # set while COMPLETE
    cursor: int  # next queue index prefetch looks at
    invalidations: int  # how many times a pass departed from its plan (over every kind)
    kind: str = "train"  # the pass kind this trace records (see `pass_kind`)
    parked: tuple[tuple[str, "TraceState"], ...] = ()  # the other kinds' traces, by kind
    departure: tuple[int, int, int] = ()  # the last invalidation: (fetch index in its pass, module
    # fetched or -1 if the pass ended early, module the plan expected there or -1 past its end)


TRAIN = "train"
UNIT_GREW = -2  # departure's "expected" when a module took params it does not own


def pass_kind(grad_enabled: bool, training: bool, grad_inputs: bool = False) -> str:
    """The kind of a pass, by what changes its module order: whether autograd records (a
    backward follows, fetching every module again), the root's train/eval mode (modules may
    branch on self.training: dropout layers skipped, caches used), and whether the root's
    inputs need grad (the backward's order: [Note: one trace per pass kind])."""
    return ("train" if training else "eval") + ("" if grad_enabled else "_no_grad") + \
        ("_grad_inputs" if grad_inputs and grad_enabled else "")


def initial_trace(kind: str = TRAIN) -> TraceState:
    return TraceState(mode=TraceMode.INVALID, step_id=0, recording=Log(), plan=None, cursor=0, invalidations=0,
                      kind=kind)


def on_fetch(tr: TraceState, module: ModuleId) -> tuple[TraceState, bool]:
    """Log a fetch of `module`; -> (trace, departed). `departed` is True when a COMPLETE plan
    expected another module here (or none). DeepSpeed: trace_prologue + record_module."""
    departed = tr.mode is TraceMode.COMPLETE and (
        tr.step_id >= len(tr.plan.order) or tr.plan.order[tr.step_id] != module)
    return tr._replace(step_id=tr.step_id + 1, recording=tr.recording.extend((module,))), departed


def advanced(tr: TraceState, cursor: int) -> TraceState:
    """The trace with prefetch's queue cursor moved to `cursor` (it only moves forward)."""
    return tr._replace(cursor=cursor)


def invalidated(tr: TraceState, module: ModuleId = -1, *, externals: bool = False) -> TraceState:
    """Drop the plan: no prefetch, no reuse-keeping, for the rest of this pass. `module` is the
    one fetched where the order departed (-1: none, the pass ended early), recorded with what the
    plan expected there in `departure` (the log names both); with `externals`, the module whose
    fetch unit grew (expected UNIT_GREW). DeepSpeed: _invalidate_trace."""
    step = tr.step_id - 1 if module >= 0 else tr.step_id  # on_fetch has counted the fetch already
    if externals:
        expected = UNIT_GREW
    else:
        expected = tr.plan.order[step] if tr.plan is not None and 0 <= step < len(tr.plan.order) else -1
    return tr._replace(mode=TraceMode.INVALID, plan=None, cursor=0,
                       invalidations=tr.invalidations + 1, departure=(step, module, expected))


def reset(tr: TraceState, unit: Callable[[ModuleId], tuple[ParamId, ...]],
          numel: Callable[[ParamId], int], max_reuse_distance: int, *, kind: str = TRAIN,
          aborted: bool = False) -> TraceState:
    """Close the pass that ran and start a pass of `kind`. For the closed pass's trace:
    INVALID -> RECORD; RECORD -> COMPLETE (freeze what was logged); COMPLETE stays COMPLETE if
    the pass matched the plan, else it records again; an `aborted` pass is forgotten (see
    [Note: aborted passes]). A new kind parks that trace and takes up its own
    ([Note: one trace per pass kind]). DeepSpeed: reset_step."""
    closed = _close(tr, unit, numel, max_reuse_distance, aborted)
    if kind == tr.kind:
        return closed
    parked = dict(tr.parked)
    parked[tr.kind] = closed._replace(parked=())
    mine = parked.pop(kind, None) or initial_trace(kind)
    mine = _close(mine, unit, numel, max_reuse_distance, False)  # INVALID -> RECORD; else as is
    return mine._replace(invalidations=closed.invalidations, departure=closed.departure,
                         parked=tuple(sorted(parked.items())))


def _close(tr: TraceState, unit: Callable[[ModuleId], tuple[ParamId, ...]],
           numel: Callable[[ParamId], int], max_reuse_distance: int, aborted: bool) -> TraceState:
    """The same trace, its pass closed: mode advanced, step 0, empty log. Closing a trace whose
    pass is already closed (step 0, nothing logged) changes only INVALID to RECORD."""
    mode, plan, invalidations = tr.mode, tr.plan, tr.invalidations
    if aborted:
        return tr._replace(mode=TraceMode.RECORD if mode is TraceMode.INVALID else mode, step_id=0,
                           recording=Log(), cursor=0)
    departure = tr.departure
    if mode is TraceMode.COMPLETE and tr.step_id not in (0, len(plan.order)):
        departure = invalidated(tr).departure  # ended early
        mode, plan, invalidations = TraceMode.INVALID, None, invalidations + 1
    if mode is TraceMode.INVALID:
        mode = TraceMode.RECORD
    elif mode is TraceMode.RECORD and len(tr.recording):
        mode, plan = TraceMode.COMPLETE, build_plan(tuple(tr.recording), unit, numel, max_reuse_distance)
    return tr._replace(mode=mode, step_id=0, recording=Log(), plan=plan, cursor=0,
                       invalidations=invalidations, departure=departure)


def build_plan(order: tuple[ModuleId, ...], unit: Callable[[ModuleId], tuple[ParamId, ...]],
               numel: Callable[[ParamId], int], max_reuse_distance: int) -> TracePlan:
    """Param queue, its offsets and reuse sets for a module order.

    The queue's offsets say how many elements of the plan lie ahead of each entry: prefetch
    reaches `prefetch_bucket_size` of them past the current step ([Note: prefetch bounds],
    fetch.py).

    A param of step s is *reused* if its next use is at step t and the modules strictly between
    s and t hold fewer than `max_reuse_distance` elements: DeepSpeed's __params_to_release walks
    forward from s + 1 adding each module's numel and stops once the sum reaches the distance.
    """
    units = [unit(m) for m in order]
    queue, step_start, offsets = [], [], [0]
    for s, pids in enumerate(units):
        step_start.append(len(queue))
        queue.extend((s, p) for p in pids)
        for p in pids:
            offsets.append(offsets[-1] + numel(p))
    step_start.append(len(queue))
    before = [0]  # before[s]: numel of steps 0..s-1
    for pids in units:
        before.append(before[-1] + sum(numel(p) for p in pids))
    reused: list[tuple[ParamId, ...]] = [()] * len(units)
    next_use: dict[ParamId, int] = {}
    for s in range(len(units) - 1, -1, -1):
        keep = set()
        for p in units[s]:
            t = next_use.get(p)
            if t is not None and before[t] - before[s + 1] < max_reuse_distance:
                keep.add(p)
            next_use[p] = s
        reused[s] = tuple(sorted(keep))
    return TracePlan(order, tuple(queue), tuple(step_start), tuple(offsets), tuple(reused))

