"""Pass- and step-level transitions: what happens between module events.

    reset_step       start of a forward pass: drain, free leftovers, advance the trace machine
    finish_backward  end of backward: drain, free every non-persistent non-external param,
                     zero the per-module backward counters (modules whose post-backward never
                     fired: no grad-requiring input)
    end_of_step      after the optimizer updated the shards: every full param is stale, so all
                     are freed but the persistent (and held) ones that were live: those are
                     refreshed in place (effects.Refresh); hpZ's secondary shards are dropped
    invalidate       a fetch departed from the trace plan: drain, drop wrong prefetches

Each walks only the params gathered since the last sweep (`ParamState.gathered`) and the
modules fetched in this pass (the trace's recording), never the whole model.
"""
from __future__ import annotations

from fz3.config.config import Config
from fz3.core.ids import ModuleId
from fz3.core.param.state import (AVAILABLE, Effects, ParamState, Txn, drain, drop_secondary, free, refresh,
                                  unit_params, with_secondary)
from fz3.core.pvec import Log
from fz3.core.param.trace import invalidated, pass_kind, reset


def sweep(tx: Txn, *, force: bool) -> None:
    """Drain, then free gathered params nothing holds: not persistent, not external and, unless
    `force`, used by no active module. `force` also drops every module from the user counts
    (the pass is over); holds (gathered_parameters) stay."""
    drain(tx)
    free(tx, tuple(tx.sweep_gathered(force)))


def invalidate(tx: Txn, module: ModuleId = -1, *, externals: bool = False) -> None:
    """The pass left its plan: no prefetch from here on, and no prefetched param left behind.
    DeepSpeed: _invalidate_trace (+ the release of in-flight params in reset_step)."""
    tx.trace = invalidated(tx.trace, module, externals=externals)
    sweep(tx, force=False)


def _idle_modules(tx: Txn) -> None:
    """Zero the backward counters of the modules fetched in this pass; none is active now."""
    for m in set(tx.trace.recording):
        tx.idle(m)


def reset_step(st: ParamState, *, config: Config, grad_enabled: bool = True, training: bool = True,
               aborted: bool = False, grad_inputs: bool = False) -> tuple[ParamState, Effects]:
    """Start of a forward pass (the root module's pre-forward): free what the last pass left,
    close its trace and take up the trace of this pass's kind (`grad_enabled`: autograd
    records; `training`: the root's train mode; fz3/core/param/trace.py, [Note: one trace per pass
    kind]). `aborted`: the last pass raised before its end. DeepSpeed: reset_step."""
    tx = Txn(st)
    sweep(tx, force=True)
    _idle_modules(tx)
    tx.next_handle = 0  # nothing is in flight after the sweep: [Note: a pass forgets]
    tx.trace = reset(tx.trace, lambda m: unit_params(tx, m), lambda p: st.spec.params[p].numel,
                     config.max_reuse_distance, kind=pass_kind(grad_enabled, training, grad_inputs), aborted=aborted)
    return tx.commit()


def finish_backward(st: ParamState, *, config: Config) -> tuple[ParamState, Effects]:
    """End of backward (autograd's queue_callback). After it, I2 holds: no gather in flight,
    every non-persistent non-external param NOT_AVAILABLE, every backward counter 0.
    DeepSpeed: release_backward_leftovers."""
    tx = Txn(st)
    sweep(tx, force=True)
    _idle_modules(tx)
    return tx.commit()


def before_step(st: ParamState) -> tuple[ParamState, Effects]:
    """Before the optimizer step: wait every gather still in flight (a prefetch the pass never
    reached: a forward cut short, or one without a backward). Its collective reads the shards
    the step writes, so on a gather stream the step would race it (the stream machine found it:
    [Note: no step over a gather in flight])."""
    tx = Txn(st)
    drain(tx)
    return tx.commit()


# [Note: no step over a gather in flight] A pass that ends before the module a prefetch was for
# (a forward cut short, or a forward with no backward) leaves that gather in flight at the
# boundary. end_of_step waits it, but after the optimizer step has written the shards the
# gather reads: on an accelerator the optimizer's writes on the compute stream raced the
# gather stream's reads, and on gloo the point-to-point carrier could send half-stepped bytes.
# `before_step` waits it first (calls.stepped). fz3/testing/stream_machine.py found it.


def end_of_step(st: ParamState, *, config: Config) -> tuple[ParamState, Effects]:
    """After the optimizer step: free every full param (they are stale) but the persistent ones
    that were live and the ones an open gathered_parameters holds (their holds stay counted):
    those are refreshed in place, in one gather (effects.Refresh). DeepSpeed: _pre_step /
    _post_step."""
    tx = Txn(st)
    drain(tx)
    live = sorted({p for p in tx.gathered if tx.status(p) == AVAILABLE})
    tx.gathered = Log()
    held = set(st.held)
    again = tuple(p for p in live if st.spec.params[p].persistent or p in held)
    kept = set(again)
    free(tx, tuple(p for p in live if p not in kept))
    refresh(tx, again)
    for p in again:  # no module is using them; a hold is a user
        tx.set_users(p, 0)
    for p in held:
        tx.set_users(p, st.held.count(p))
    if st.spec.secondary > 1:  # hpZ: the secondary shards are of the old values ([Note: hpZ])
        drop_secondary(tx, with_secondary(tx))
    return tx.commit()
