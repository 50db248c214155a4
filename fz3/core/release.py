"""release: after a module ran (post-forward) or got its input grads (post-backward), free the
full params nobody needs any more.

    release(module)
      - drop `module` from each of its params' active sets
      - candidates: AVAILABLE, active set now empty, not persistent, not external
      - COMPLETE trace only, keep a candidate if
          * a module within max_reuse_distance numel ahead in the plan uses it (tied weights), or
          * it was prefetched for a later step of this pass
        unless keeping them would leave more than max_live_parameters live
      - free the rest, in one Free
"""
from __future__ import annotations

from fz3.core.config import Config
from fz3.core.ids import ModuleId, ParamId, Status, TraceMode
from fz3.core.state import Effects, ParamState, free, unit_params


def release(st: ParamState, module: ModuleId, *, config: Config) -> tuple[ParamState, Effects]:
    """Post-forward / post-backward of `module`. DeepSpeed: release_sub_module with
    __params_to_release. Departs from DeepSpeed in one way: DeepSpeed's reuse-keeping ignores
    max_live_parameters; here a keep that would exceed it is dropped, so DeepSpeed's documented
    meaning ("the maximum number of parameters resident per GPU before releasing") holds."""
    slots, spec = st.params, st.spec.params
    updates, candidates = [], []
    for p in unit_params(st, module):
        s = slots[p]
        if module not in s.active:
            continue  # not fetched by this module in this pass (e.g. after a forced sweep)
        active = s.active - {module}
        updates.append((p, s._replace(active=active)))
        if not active and s.status is Status.AVAILABLE and not spec[p].persistent and not s.external:
            candidates.append(p)
    st = st._replace(params=slots.set_many(updates))
    keep = _keep_for_reuse(st, module, candidates, config)
    return free(st, tuple(p for p in candidates if p not in keep))


def _keep_for_reuse(st: ParamState, module: ModuleId, candidates: list[ParamId],
                    config: Config) -> frozenset[ParamId]:
    tr = st.trace
    step = st.modules[module].fetch_step
    if tr.mode is not TraceMode.COMPLETE or not candidates or not (
            0 <= step < len(tr.plan.order) and tr.plan.order[step] == module):
        return frozenset()
    reused, slots = tr.plan.reused[step], st.params
    keep = frozenset(p for p in candidates if p in reused or slots[p].fetched_for > step)
    spec = st.spec.params
    freed = sum(spec[p].numel for p in candidates if p not in keep)
    return keep if st.live_numel - freed <= config.max_live_parameters else frozenset()
