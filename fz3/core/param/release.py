"""release: after a module ran (post-forward) or got its input grads (post-backward), free the
full params nobody needs any more.

    release(module)
      - close one open call of `module`; at the last, count it out of its params' users
        (DeepSpeed: ds_active_sub_modules)
      - candidates: AVAILABLE, no user left, not persistent, not external
      - COMPLETE trace only, keep a candidate if
          * a module within max_reuse_distance numel ahead in the plan uses it (tied weights), or
          * it was prefetched for a later step of this pass
        unless keeping them would leave more than max_live_parameters live
      - free the rest, in one Free, marked `refetch` when this module's backward will fetch
        them again in this pass (an interpreter may keep their memory for that gather)
"""
from __future__ import annotations

from fz3.config.config import Config
from fz3.core.ids import ModuleId, ParamId, TraceMode
from fz3.core.param.state import Effects, ParamState, Txn, free


def release(st: ParamState, module: ModuleId, *, config: Config,
            grad_outputs: bool = False) -> tuple[ParamState, Effects]:
    """Post-forward / post-backward of `module`. DeepSpeed: release_sub_module with
    __params_to_release. Departs from DeepSpeed in one way: DeepSpeed's reuse-keeping ignores
    max_live_parameters; here a keep that would exceed it is dropped, so DeepSpeed's documented
    meaning ("the maximum number of parameters resident per GPU before releasing") holds.

    `grad_outputs`: in forward, the shell wrapped this call's outputs for pre-backward, which
    counts one more backward fetch (the output half of DeepSpeed's post-forward hooks)."""
    tx = Txn(st)
    if grad_outputs:
        tx.count_backward_fetch(module)
    release_into(tx, module, config=config)
    return tx.commit()


def release_into(tx: Txn, module: ModuleId, *, config: Config) -> None:
    candidates = tx.close_call(module)  # none if another call of it is still open
    if not candidates:
        return
    keep = _keep_for_reuse(tx, module, candidates, config)
    free(tx, tuple(p for p in candidates if p not in keep) if keep else tuple(candidates),
         refetch=tx.pre_backward(module) > 0)  # its backward gathers them again


def _keep_for_reuse(tx: Txn, module: ModuleId, candidates: list[ParamId],
                    config: Config) -> list[ParamId]:
    """The candidates a COMPLETE plan says to keep: reused soon, or prefetched for later."""
    tr = tx.trace
    step = tx.fetch_step(module)
    if tr.mode is not TraceMode.COMPLETE or not (
            0 <= step < len(tr.plan.order) and tr.plan.order[step] == module):
        return []
    reused, fetched_for, now = tr.plan.reused[step], tx.fetched_for, tr.step_id - 1
    # prefetched for a step still to come (a later fetch that already ran, a child sharing the
    # param, marks it too, and keeps nothing: DeepSpeed compares with __step_id at the release)
    keep = [p for p in candidates if p in reused or fetched_for(p) > now]
    if not keep:
        return keep
    spec = tx.st.spec.params
    freed = sum(spec[p].numel for p in candidates if p not in keep)
    return keep if tx.live - freed <= config.max_live_parameters else []
