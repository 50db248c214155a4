"""Pass- and step-level transitions: what happens between module events.

    reset_step       start of a forward pass: drain, free leftovers, advance the trace machine
    finish_backward  end of backward: drain, free every non-persistent non-external param,
                     zero the per-module backward counters (modules whose post-backward never
                     fired: no grad-requiring input)
    end_of_step      after the optimizer updated the shards: every full param is stale, so all
                     are freed; the persistent ones that were live are gathered again at once
    invalidate       a fetch departed from the trace plan: drain, drop wrong prefetches

Each walks only the params gathered since the last sweep (`ParamState.gathered`) and the
modules fetched in this pass (the trace's recording), never the whole model.
"""
from __future__ import annotations

from fz3.core.config import Config
from fz3.core.ids import ParamId, Status
from fz3.core.state import IDLE_MODULE, Effects, ParamState, drain, free, gather, unit_params, wait
from fz3.core.trace import invalidated, iter_cons, reset


def sweep(st: ParamState, *, force: bool) -> tuple[ParamState, Effects]:
    """Drain, then free gathered params nothing holds: not persistent, not external and, unless
    `force`, used by no active module. `force` also clears every active set (pass is over)."""
    st, effects = drain(st)
    slots, spec = st.params, st.spec.params
    seen: set[ParamId] = set()
    to_free, survivors, cleared = [], None, []
    for p in iter_cons(st.gathered):
        if p in seen:
            continue
        seen.add(p)
        s = slots[p]
        if s.status is not Status.AVAILABLE:
            continue
        if spec[p].persistent or s.external or (s.active and not force):
            survivors = (p, survivors)
            if force and s.active:
                cleared.append((p, s._replace(active=frozenset())))
        else:
            to_free.append(p)
    st = st._replace(params=slots.set_many(cleared), gathered=survivors)
    st, e = free(st, tuple(sorted(to_free)))
    return st, effects + e


def invalidate(st: ParamState) -> tuple[ParamState, Effects]:
    """The pass left its plan: no prefetch from here on, and no prefetched param left behind.
    DeepSpeed: _invalidate_trace (+ the release of in-flight params in reset_step)."""
    st = st._replace(trace=invalidated(st.trace))
    return sweep(st, force=False)


def _idle_modules(st: ParamState) -> ParamState:
    """Zero the backward counters of the modules fetched in this pass."""
    mods = st.modules
    seen = {m for m in iter_cons(st.trace.recording)}
    updates = [(m, IDLE_MODULE._replace(externals=mods[m].externals)) for m in sorted(seen)
               if mods[m][:3] != IDLE_MODULE[:3]]
    return st._replace(modules=mods.set_many(updates))


def reset_step(st: ParamState, *, config: Config) -> tuple[ParamState, Effects]:
    """Start of a forward pass (the root module's pre-forward). DeepSpeed: reset_step."""
    st, effects = sweep(st, force=True)
    st = _idle_modules(st)
    trace = reset(st.trace, lambda m: unit_params(st, m), lambda p: st.spec.params[p].numel,
                  config.max_reuse_distance)
    return st._replace(trace=trace), effects


def finish_backward(st: ParamState, *, config: Config) -> tuple[ParamState, Effects]:
    """End of backward (autograd's queue_callback). After it, I2 holds: no gather in flight,
    every non-persistent non-external param NOT_AVAILABLE, every backward counter 0.
    DeepSpeed: release_backward_leftovers."""
    st, effects = sweep(st, force=True)
    return _idle_modules(st), effects


def end_of_step(st: ParamState, *, config: Config) -> tuple[ParamState, Effects]:
    """After the optimizer step: free every full param (they are stale), then gather the
    persistent ones that were live again, in one gather. DeepSpeed: _pre_step / _post_step."""
    st, effects = drain(st)
    slots, spec = st.params, st.spec.params
    live = sorted({p for p in iter_cons(st.gathered) if slots[p].status is Status.AVAILABLE})
    st = st._replace(gathered=None)
    st, e = free(st, tuple(live))
    effects += e
    again = tuple(p for p in live if spec[p].persistent)
    if again:
        st, e = gather(st, again, prefetch=False, forward=True, fetched_for=(-1,) * len(again))
        st, w = wait(st, st.inflight[-1].handle)
        effects += e + w
    return st, effects
