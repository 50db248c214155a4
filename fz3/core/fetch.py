"""fetch: make a module's params AVAILABLE before it computes, and prefetch what comes next.

    fetch(module)
      0. trace prologue: log the fetch; if a COMPLETE plan expected another module, invalidate
      1. gather   - one AllGather of the module's NOT_AVAILABLE params        (never refused)
      2. wait     - every in-flight gather carrying one of its params
      3. prefetch - COMPLETE trace only: walk the plan's param queue past this step, take
                    NOT_AVAILABLE params while the batch is below prefetch_bucket_size and
                    the live numel stays within max_live_parameters; issue them as one
                    AllGather, not waited (at most 2 gathers in flight)

[Note: prefetch bounds] prefetch_bucket_size is a batching size, as in DeepSpeed: params are
taken while the batch is still below it, so the last one may overshoot it (a param larger than
the bucket is still prefetched, alone). max_live_parameters is a memory bound and is hard:
DeepSpeed's loop may overshoot it by one param; fz3 stops *before* a param that would lift the
live numel past it, so I1 holds exactly. Such a param is fetched on demand instead.
"""
from __future__ import annotations

from fz3.core.config import Config
from fz3.core.ids import ModuleId, ParamId, Status, TraceMode
from fz3.core.state import Effects, ParamState, gather, unit_params, wait_for
from fz3.core.step import invalidate
from fz3.core.trace import on_fetch


def fetch(st: ParamState, module: ModuleId, *, forward: bool, config: Config) -> tuple[ParamState, Effects]:
    """Pre-forward / pre-backward of `module`: its params are AVAILABLE when this returns.
    DeepSpeed: PartitionedParameterCoordinator.fetch_sub_module."""
    trace, departed = on_fetch(st.trace, module)
    st = st._replace(trace=trace)
    effects: Effects = ()
    if departed:
        st, effects = invalidate(st)
    step = trace.step_id - 1
    pids = unit_params(st, module)
    st = _activate(st, module, pids, step)
    slots = st.params
    missing = tuple(p for p in pids if slots[p].status is Status.NOT_AVAILABLE)
    if missing:
        st, e = gather(st, missing, prefetch=False, forward=forward, fetched_for=(step,) * len(missing))
        effects += e
    st, e = wait_for(st, pids)
    effects += e
    if st.trace.mode is TraceMode.COMPLETE and config.prefetch_bucket_size > 0:
        st, e = prefetch(st, step, forward=forward, config=config)
        effects += e
    return st, effects


def _activate(st: ParamState, module: ModuleId, pids: tuple[ParamId, ...], step: int) -> ParamState:
    """Mark `module` as using `pids` (DeepSpeed's ds_active_sub_modules) at trace step `step`."""
    slots = st.params
    updates = []
    for p in pids:
        s = slots[p]
        updates.append((p, s._replace(active=s.active | {module}, fetched_for=max(s.fetched_for, step))))
    mods = st.modules
    return st._replace(params=slots.set_many(updates),
                       modules=mods.set(module, mods[module]._replace(fetch_step=step)))


def prefetch(st: ParamState, step: int, *, forward: bool, config: Config) -> tuple[ParamState, Effects]:
    """Gather, ahead of need, the next NOT_AVAILABLE params of the plan that fit the budget.

    The queue cursor only moves forward, so a whole pass walks the queue once (O(1) amortized
    per fetch). Params already AVAILABLE or INFLIGHT are stepped over; the walk stops at the
    first param that does not fit, which the next fetch looks at again.
    """
    plan, slots, spec = st.trace.plan, st.params, st.spec.params
    queue = plan.queue
    i = max(st.trace.cursor, plan.step_start[step + 1])
    room = config.max_live_parameters - st.live_numel
    chosen: dict[ParamId, int] = {}
    numel = 0
    while i < len(queue) and numel < config.prefetch_bucket_size:
        t, p = queue[i]
        if slots[p].status is Status.NOT_AVAILABLE and p not in chosen:
            n = spec[p].numel
            if numel + n > room:
                break
            chosen[p] = t
            numel += n
        i += 1
    st = st._replace(trace=st.trace._replace(cursor=i))
    if not chosen:
        return st, ()
    pids = tuple(sorted(chosen))
    return gather(st, pids, prefetch=True, forward=forward, fetched_for=tuple(chosen[p] for p in pids))
