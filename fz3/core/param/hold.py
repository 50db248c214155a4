"""Holding params whole outside any module: the core half of `fz3.gathered_parameters`.

    hold(pids)     each param gains a user; the NOT_AVAILABLE ones are gathered and waited
    unhold(pids)   each loses it; with `stale` (the full values may have been edited, or the
                   shards rewritten), params no module uses are freed even if persistent or
                   external, so the next fetch gathers the current shards
    gather_persistent   every persistent param not live is gathered and waited, for no
                   module (at the outermost call's enter and after a stale unhold inside a
                   call: fz3/core/calls.py, `enter` and `unhold`)

A hold counts like an active module in a param's `users`, so no release frees a held param.
DeepSpeed: GatheredParameters.__enter__ / __exit__.
"""
from __future__ import annotations

from fz3.config.config import Config
from fz3.core.param.state import (AVAILABLE, NOT_AVAILABLE, Effects, ParamState, Txn, drop_secondary, free, gather,
                                  wait_for)
from fz3.core.ids import ParamId


def hold(st: ParamState, pids: tuple[ParamId, ...], *, config: Config) -> tuple[ParamState, Effects]:
    pids = tuple(sorted(set(pids)))
    tx = Txn(st)
    missing = tx.add_user(pids)
    if missing:
        gather(tx, tuple(missing), prefetch=False, forward=True, fetched_for=(-1,) * len(missing))
    wait_for(tx, pids)
    new, effects = tx.commit()
    return new._replace(held=tuple(sorted(st.held + pids))), effects


def unhold(st: ParamState, pids: tuple[ParamId, ...], *, config: Config,
           stale: bool = True) -> tuple[ParamState, Effects]:
    pids = tuple(sorted(set(pids)))
    held = list(st.held)
    for p in pids:
        if p not in held:
            raise ValueError(f"unhold of param {st.spec.params[p].name}, which is not held")
        held.remove(p)
    tx = Txn(st)
    to_free = []
    for p in pids:
        users = tx.users(p) - 1
        tx.set_users(p, users)
        keep = st.spec.params[p].persistent or tx.is_external(p)
        if not users and tx.status(p) == AVAILABLE and (stale or not keep):
            to_free.append(p)
    free(tx, tuple(to_free))
    if stale:  # their shards were rewritten: a secondary shard would be of the old values
        drop_secondary(tx, pids)
    new, effects = tx.commit()
    return new._replace(held=tuple(held)), effects


def gather_persistent(st: ParamState) -> tuple[ParamState, Effects]:
    """[Note: persistent params stay live] Gather every persistent param not live, for no
    module (no user, no trace step), and wait. At an outermost call's enter (once a pass), and
    after a stale unhold inside a call (gathered_parameters with a modifier_rank, exited in a
    forward): so while any call is open, every persistent param is live (the step refreshes
    them in place, and only a stale unhold or new shards free them), and a call of an inert
    module inside another needs no event ([Note: inert modules], fz3/core/calls.py).
    O(params), but only there."""
    missing = tuple(ps.id for ps in st.spec.params if ps.persistent and st.status(ps.id) == NOT_AVAILABLE)
    if not missing:
        return st, ()
    tx = Txn(st)
    gather(tx, missing, prefetch=False, forward=True, fetched_for=(-1,) * len(missing))
    wait_for(tx, missing)
    return tx.commit()
