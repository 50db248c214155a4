"""Backward bookkeeping and external parameters.

    forward call of m:  outputs_wrapped(m)        pre_backward count  += 1
                        inputs_wrapped(m, k)      grads_remaining     += k  (grad-requiring inputs)
    backward:           pre_backward(m)           count > 0: count -= 1, fetch(m)
                        post_backward(m)          grads_remaining -= 1; at 0: release(m)

A module called k times in forward is fetched k times in backward, and both counts return to 0
(ALBERT-style reuse, DeepSpeed PR #1227). A module with no grad-requiring input never gets a
post-backward; `step.finish_backward` releases it.

External params: a param a module returns in its outputs, or reads from a module it does not
call, is registered on the module that uses it. It is gathered now, fetched with that module
from then on, never freed by a release, and freed at the end of the optimizer step.
"""
from __future__ import annotations

from fz3.core.config import Config
from fz3.core.fetch import fetch
from fz3.core.ids import ModuleId, ParamId, Status, TraceMode
from fz3.core.release import release
from fz3.core.state import Effects, ParamState, gather, wait_for
from fz3.core.step import invalidate


def outputs_wrapped(st: ParamState, module: ModuleId) -> ParamState:
    """A forward call of `module` produced grad-requiring outputs (PreBackwardFunction applied)."""
    m = st.modules[module]
    return st._replace(modules=st.modules.set(module, m._replace(pre_backward=m.pre_backward + 1)))


def inputs_wrapped(st: ParamState, module: ModuleId, count: int) -> ParamState:
    """A forward call of `module` got `count` grad-requiring inputs (PostBackwardFunction)."""
    if count < 0:
        raise ValueError(f"inputs_wrapped count must be >= 0, got {count}")
    m = st.modules[module]
    return st._replace(modules=st.modules.set(module, m._replace(grads_remaining=m.grads_remaining + count)))


def pre_backward(st: ParamState, module: ModuleId, *, config: Config) -> tuple[ParamState, Effects]:
    """Gradient reached `module`'s outputs: fetch its params, once per forward call.
    DeepSpeed: _run_before_backward_function."""
    m = st.modules[module]
    if m.pre_backward == 0:
        return st, ()
    st = st._replace(modules=st.modules.set(module, m._replace(pre_backward=m.pre_backward - 1)))
    return fetch(st, module, forward=False, config=config)


def post_backward(st: ParamState, module: ModuleId, *, config: Config) -> tuple[ParamState, Effects]:
    """One grad-requiring input of `module` got its grad; at the last, release.
    DeepSpeed: PostBackwardFunctionModule.backward."""
    m = st.modules[module]
    if m.grads_remaining == 0:
        return st, ()
    st = st._replace(modules=st.modules.set(module, m._replace(grads_remaining=m.grads_remaining - 1)))
    if m.grads_remaining > 1:
        return st, ()
    return release(st, module, config=config)


def register_external(st: ParamState, module: ModuleId, pids: tuple[ParamId, ...], *,
                      config: Config) -> tuple[ParamState, Effects]:
    """`module` uses params it does not own; make them AVAILABLE now and part of its fetch unit.
    DeepSpeed: register_external_parameter / the post-forward dangling-param scan."""
    m = st.modules[module]
    new = tuple(sorted(set(pids) - set(m.externals) - set(st.spec.modules[module].params)))
    if not new:
        return st, ()
    effects: Effects = ()
    if st.trace.mode is TraceMode.COMPLETE:
        st, effects = invalidate(st)  # the plan's fetch units changed
    slots = st.params
    updates = [(p, slots[p]._replace(external=True, active=slots[p].active | {module})) for p in new]
    mods = st.modules
    st = st._replace(params=slots.set_many(updates), modules=mods.set(
        module, m._replace(externals=tuple(sorted(m.externals + new)))))
    missing = tuple(p for p in new if st.params[p].status is Status.NOT_AVAILABLE)
    if missing:
        step = st.modules[module].fetch_step
        st, e = gather(st, missing, prefetch=False, forward=True, fetched_for=(step,) * len(missing))
        effects += e
    st, e = wait_for(st, new)
    return st, effects + e
