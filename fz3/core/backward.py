"""Backward bookkeeping and external parameters.

    forward call of m:  outputs_wrapped(m)        pre_backward count  += 1
                        inputs_wrapped(m, k)      grads_remaining     += k  (k = 1: the call's
                                                  grad-requiring inputs were wrapped, in one node)
    backward:           pre_backward(m)           count > 0: count -= 1, fetch(m): a call opens
                        post_backward(m)          grads_remaining -= 1, release(m): it closes

A module called k times in forward is fetched k times in backward, and both counts return to 0
(ALBERT-style reuse, DeepSpeed PR #1227). A module with no grad-requiring input never gets a
post-backward; `step.finish_backward` releases it (the shell releases it earlier, once its own
params' grads are in).

[Note: release per call] DeepSpeed wraps each input apart and releases a module when its
ds_grads_remaining reaches 0, i.e. after the backward of *all* its calls: a block applied k
times keeps its params (and its children's) gathered from its first backward call to its last,
with other modules fetched on demand on top, past any live budget. fz3's shell wraps all of a
call's grad-requiring inputs in one node, so each post_backward ends one call's backward and
releases what that call's pre_backward fetched; the params are freed (or kept, by the trace's
reuse rule) once no call of the module is open. Calls whose backward interleaves stay correct:
`active` counts open calls, and only the last one to close counts the module out.

External params: a param a module returns in its outputs, or reads from a module it does not
call, is registered on the module that uses it. It is gathered now, fetched with that module
from then on, never freed by a release, and freed at the end of the optimizer step.
"""
from __future__ import annotations

from fz3.config.config import Config
from fz3.core.fetch import fetch_into
from fz3.core.ids import ModuleId, ParamId, TraceMode
from fz3.core.release import release_into
from fz3.core.state import (ACTIVE, EXTERNALS, FETCH_STEP, FETCHED_FOR, GRADS_REMAINING, HANDLE,
                            NOT_AVAILABLE, PRE_BACKWARD, STATUS, USERS, Effects, ParamState, Txn,
                            gather, wait_for)
from fz3.core.step import invalidate


def outputs_wrapped(st: ParamState, module: ModuleId) -> ParamState:
    """A forward call of `module` produced grad-requiring outputs (PreBackwardFunction applied).
    The same as `release(..., grad_outputs=True)` does, for shells that report it apart."""
    m = st.module_rows[module]
    return st._replace(module_rows=st.module_rows.set(module, (m[PRE_BACKWARD] + 1,) + m[1:]))


def inputs_wrapped(st: ParamState, module: ModuleId, count: int) -> ParamState:
    """A forward call of `module` got `count` grad-requiring inputs (PostBackwardFunction).
    The same as `fetch(..., grad_inputs=count)` does, for shells that report it apart."""
    if count not in (0, 1):
        raise ValueError(f"inputs_wrapped count must be 0 or 1 (one node per call), got {count!r}")
    m = st.module_rows[module]
    return st._replace(module_rows=st.module_rows.set(
        module, (m[PRE_BACKWARD], m[GRADS_REMAINING] + count) + m[2:]))


def pre_backward(st: ParamState, module: ModuleId, *, config: Config) -> tuple[ParamState, Effects]:
    """Gradient reached `module`'s outputs: fetch its params, once per forward call.
    DeepSpeed: _run_before_backward_function."""
    m = st.module_rows[module]
    if m[PRE_BACKWARD] == 0:
        return st, ()
    tx = Txn(st)
    tx.put_module(module, (m[PRE_BACKWARD] - 1,) + m[1:])
    fetch_into(tx, module, forward=False, config=config)
    return tx.commit()


def post_backward(st: ParamState, module: ModuleId, *, config: Config) -> tuple[ParamState, Effects]:
    """A call's grad-requiring inputs got their grads: its backward is done, release what it
    fetched (see [Note: release per call]). DeepSpeed: PostBackwardFunctionModule.backward."""
    m = st.module_rows[module]
    if m[GRADS_REMAINING] == 0:
        return st, ()
    tx = Txn(st)
    tx.put_module(module, (m[PRE_BACKWARD], m[GRADS_REMAINING] - 1) + m[2:])
    release_into(tx, module, config=config)
    return tx.commit()


def register_external(st: ParamState, module: ModuleId, pids: tuple[ParamId, ...], *,
                      config: Config) -> tuple[ParamState, Effects]:
    """`module` uses params it does not own; make them AVAILABLE now and part of its fetch unit.
    DeepSpeed: register_external_parameter / the post-forward dangling-param scan."""
    m = st.module_rows[module]
    new = tuple(sorted(set(pids) - set(m[EXTERNALS]) - set(st.spec.modules[module].params)))
    if not new:
        return st, ()
    tx = Txn(st)
    if tx.trace.mode is TraceMode.COMPLETE:
        invalidate(tx, module, externals=True)  # the plan's fetch units changed
    missing = []
    for p in new:
        s = tx.slots[p]
        tx.put(p, (s[STATUS], s[HANDLE], s[USERS] + (m[ACTIVE] > 0), s[FETCHED_FOR], True))
        if s[STATUS] == NOT_AVAILABLE:
            missing.append(p)
    tx.put_module(module, m[:EXTERNALS] + (tuple(sorted(m[EXTERNALS] + new)),))
    if missing:
        gather(tx, tuple(missing), prefetch=False, forward=True,
               fetched_for=(m[FETCH_STEP],) * len(missing))
    wait_for(tx, new)
    return tx.commit()
