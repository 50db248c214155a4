"""Backward bookkeeping and external parameters.

    forward call of m:  release(m, grad_outputs=True)   pre_backward count  += 1
                        fetch(m, grad_inputs=k)         grads_remaining     += k  (k = 1: the
                                                        call's grad-requiring inputs were
                                                        wrapped, in one node)
    backward:           fetch_for_backward(m)           count > 0: count -= 1, fetch(m): a call
                                                        opens
                        release_after_backward(m)       grads_remaining -= 1, release(m): it
                                                        closes

The shell's events of the same moments are PreBackwardRan and PostBackwardRan
(fz3/core/events.py); fz3/core/calls.py decides when each of these runs.

A module called k times in forward is fetched k times in backward, and both counts return to 0
(ALBERT-style reuse, DeepSpeed PR #1227). A module with no grad-requiring input never gets a
post-backward; `step.finish_backward` releases it (the shell releases it earlier, once its own
params' grads are in).

[Note: release per call] DeepSpeed wraps each input apart and releases a module when its
ds_grads_remaining reaches 0, i.e. after the backward of *all* its calls: a block applied k
times keeps its params (and its children's) gathered from its first backward call to its last,
with other modules fetched on demand on top, past any live budget. fz3's shell wraps all of a
call's grad-requiring inputs in one node, so each release_after_backward ends one call's
backward and releases what that call's fetch_for_backward fetched; the params are freed (or
kept, by the trace's reuse rule) once no call of the module is open. Calls whose backward interleaves stay correct:
`active` counts open calls, and only the last one to close counts the module out.

External params: a param a module returns in its outputs, or reads from a module it does not
call, is registered on the module that uses it. It is gathered now, fetched with that module
from then on, never freed by a release, and freed at the end of the optimizer step.
"""
from __future__ import annotations

from fz3.config.config import Config
from fz3.core.param.fetch import fetch_into
from fz3.core.ids import ModuleId, ParamId, TraceMode
from fz3.core.param.release import release_into
from fz3.core.param.state import Effects, ParamState, Txn, gather, wait_for
from fz3.core.param.step import invalidate


def fetch_for_backward(st: ParamState, module: ModuleId, *, config: Config) -> tuple[ParamState, Effects]:
    """Gradient reached `module`'s outputs: fetch its params, once per forward call.
    DeepSpeed: _run_before_backward_function."""
    if st.pre_backward(module) == 0:
        return st, ()
    tx = Txn(st)
    tx.take_backward_fetch(module)
    fetch_into(tx, module, forward=False, config=config)
    return tx.commit()


def release_after_backward(st: ParamState, module: ModuleId, *, config: Config) -> tuple[ParamState, Effects]:
    """A call's grad-requiring inputs got their grads: its backward is done, release what it
    fetched (see [Note: release per call]). DeepSpeed: PostBackwardFunctionModule.backward."""
    if st.grads_remaining(module) == 0:
        return st, ()
    tx = Txn(st)
    tx.take_backward_release(module)
    release_into(tx, module, config=config)
    return tx.commit()


def register_external(st: ParamState, module: ModuleId, pids: tuple[ParamId, ...], *,
                      config: Config) -> tuple[ParamState, Effects]:
    """`module` uses params it does not own; make them AVAILABLE now and part of its fetch unit.
    DeepSpeed: register_external_parameter / the post-forward dangling-param scan."""
    new = tuple(sorted(set(pids) - set(st.externals(module)) - set(st.spec.modules[module].params)))
    if not new:
        return st, ()
    tx = Txn(st)
    if tx.trace.mode is TraceMode.COMPLETE:
        invalidate(tx, module, externals=True)  # the plan's fetch units changed
    missing = tx.add_externals(module, new)
    if missing:
        gather(tx, tuple(missing), prefetch=False, forward=True,
               fetched_for=(tx.fetch_step(module),) * len(missing))
    wait_for(tx, new)
    return tx.commit()
