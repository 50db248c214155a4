"""fetch: make a module's params AVAILABLE before it computes, and prefetch what comes next.

    fetch(module)
      0. trace prologue: log the fetch; if a COMPLETE plan expected another module, invalidate
      1. gather   - one AllGather of the module's NOT_AVAILABLE params        (never refused)
      2. wait     - every in-flight gather carrying one of its params
      3. prefetch - COMPLETE trace only: walk the plan's param queue past this step, as far as
                    prefetch_bucket_size elements of the plan ahead, taking NOT_AVAILABLE params
                    while the live numel stays within max_live_parameters; issue them as one
                    AllGather, not waited (at most 2 gathers in flight)

[Note: prefetch bounds] Both bounds are memory bounds here, and both depart from DeepSpeed.

prefetch_bucket_size is how far ahead prefetch reaches: the params it gathers are used within
that many elements of the plan past the current step (the queue's entries, a param used twice
counted twice; the entry where the reach ends is taken whole, so one param may overshoot it).
So params gathered ahead of need never hold more than the bucket plus one param: what
DeepSpeed's documentation calls it, "the size of the fixed buffer for prefetching parameters".
DeepSpeed's fetch_sub_module instead takes up to min(bucket, max_live_parameters - live)
*more* at every fetch. Each module's fetch then lets its prefetch run another bucket ahead, so
what is gathered ahead grows to max_live_parameters: with the defaults (5e7, 1e9) fz3.plan of
bench's 1.02 B GPT on 2 ranks held 990 M params gathered at the forward's end (3.7 GiB a rank in
fp32), where this rule holds 504 M; real DeepSpeed 0.19.8 holds 98-99 % of a GPT gathered or in
flight at the forward's end, with its default budgets scaled to the model (bench/diagnostics/prefetch_depth.py,
bench/RESULTS.md "Prefetch reaches a bucket ahead"). On that GPT's plan the same bytes are
gathered a step, and 116 of its 117 gathers are prefetched, where 34 of 58 were fetched on demand
before: the old walk ran into max_live_parameters, and the modules past it waited for their own.

max_live_parameters is a hard bound: DeepSpeed's loop may overshoot it by one param; fz3 stops
*before* a param that would lift the live numel past it, so I1 holds exactly. Such a param is
fetched on demand instead.
"""
from __future__ import annotations

from bisect import bisect_left

from fz3.config.config import Config
from fz3.core.ids import ModuleId, TraceMode
from fz3.core.param.state import Effects, ParamState, Txn, gather, wait_for
from fz3.core.param.step import invalidate
from fz3.core.param.trace import advanced, on_fetch


def fetch(st: ParamState, module: ModuleId, *, forward: bool, config: Config,
          grad_inputs: int = 0) -> tuple[ParamState, Effects]:
    """Pre-forward / pre-backward of `module`: its params are AVAILABLE when this returns.

    `grad_inputs`: in forward, 1 if the shell wrapped this call's grad-requiring inputs, so the
    call will send one post_backward (see backward.py), else 0. DeepSpeed: PartitionedParameterCoordinator.
    fetch_sub_module, plus the input half of _post_backward_module_hook."""
    if grad_inputs not in (0, 1):
        raise ValueError(f"grad_inputs must be 0 or 1 (one PostBackward node wraps all of a call's "
                         f"grad-requiring inputs), got {grad_inputs!r}")
    tx = Txn(st)
    fetch_into(tx, module, forward=forward, config=config, grad_inputs=grad_inputs)
    return tx.commit()


def fetch_into(tx: Txn, module: ModuleId, *, forward: bool, config: Config, grad_inputs: int = 0) -> None:
    tx.trace, departed = on_fetch(tx.trace, module)
    step = tx.trace.step_id - 1
    pids, missing = tx.open_call(module, step, grad_inputs)  # counted once among its users
    if departed:  # after counting this module in: its own prefetched params stay
        invalidate(tx, module)
    if missing:
        gather(tx, tuple(missing), prefetch=False, forward=forward, fetched_for=(step,) * len(missing))
    wait_for(tx, pids)
    if tx.trace.mode is TraceMode.COMPLETE and config.prefetch_bucket_size > 0:
        prefetch(tx, step, forward=forward, config=config)


def prefetch(tx: Txn, step: int, *, forward: bool, config: Config) -> None:
    """Gather, ahead of need, the NOT_AVAILABLE params of the plan within reach that fit.

    The reach: the queue entries that start less than prefetch_bucket_size elements past the
    start of the next step. The queue cursor only moves forward, so a whole pass walks the queue
    once (O(1) amortized per fetch, plus a bisection for the reach). Params already AVAILABLE or
    INFLIGHT are stepped over; the walk stops at the reach or at the first param that does not
    fit, which the next fetch looks at again.
    """
    tr = tx.trace
    plan = tr.plan
    start = plan.step_start[step + 1]
    reach = min(bisect_left(plan.offsets, plan.offsets[start] + config.prefetch_bucket_size, start),
                len(plan.queue))
    chosen, i = tx.not_available_fitting(plan.queue, max(tr.cursor, start), reach,
                                         config.max_live_parameters - tx.live)
    tx.trace = advanced(tr, i)
    if chosen:
        pids = tuple(sorted(chosen))
        gather(tx, pids, prefetch=True, forward=forward, fetched_for=tuple(chosen[p] for p in pids))
