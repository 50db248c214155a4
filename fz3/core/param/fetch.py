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
    """Gather, ahead of need, the next NOT_AVAILABLE params of the plan that fit.

    The queue cursor only moves forward, so a whole pass walks the queue once (O(1) amortized
    per fetch). Params already AVAILABLE or INFLIGHT are stepped over; the walk stops at the
    first param that does not fit, which the next fetch looks at again.
    """
    tr = tx.trace
    chosen, i = tx.not_available_fitting(tr.plan.queue, max(tr.cursor, tr.plan.step_start[step + 1]),
                                         config.prefetch_bucket_size, config.max_live_parameters - tx.live)
    tx.trace = advanced(tr, i)
    if chosen:
        pids = tuple(sorted(chosen))
        gather(tx, pids, prefetch=True, forward=forward, fetched_for=tuple(chosen[p] for p in pids))
