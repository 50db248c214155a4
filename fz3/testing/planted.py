"""Planted bugs: replacements of fz3 functions that break one rule each, for showing that the
machines catch them (`python -m fz3 verify --patch`, bench/diagnostics/hunt.py, docs/verify.md).

    name      the function it replaces              the rule it breaks                  caught by
    release   fz3.core.param.release:release_into   a param still in use is freed       params
    boundary  fz3.core.grad.grads:flush_waiting     the boundary forgets the grads      grads
                                                    that waited in param.grad
    read      fz3.core.calls:read                   a borrowed param is not registered  calls
                                                    on its reader

    python -m fz3 verify --profile hunt --machines params \
        --patch fz3.core.param.release:release_into=fz3.testing.planted:release_ignoring_other_users

Each calls the original, where it needs it, through this module's own import of it, which a
patch leaves alone ([Note: every binding] in fz3/testing/patch.py). The teeth tests
(property_tests/test_*_teeth.py) plant these and many more; the three here are one per
machine, for the hunt (fz3/testing/profiles.py).
"""
from __future__ import annotations

from typing import NamedTuple

from fz3.config.config import Config
from fz3.core.calls import Lifecycle
from fz3.core.grad.grads import GradState
from fz3.core.ids import ModuleId
from fz3.core.param.release import free, release_into
from fz3.core.param.state import AVAILABLE, Txn, unit_params


def release_ignoring_other_users(tx: Txn, module: ModuleId, *, config: Config) -> None:
    """Release frees its module's params even when another active module (a parent sharing a
    tied weight with the child it calls) or a gathered_parameters still uses them."""
    was_active, pids = tx.active(module), unit_params(tx, module)
    release_into(tx, module, config=config)
    spec = tx.st.spec.params
    still_used = tuple(p for p in pids if tx.status(p) == AVAILABLE and tx.users(p)
                       and not spec[p].persistent and not tx.is_external(p))
    if was_active and still_used:
        free(tx, still_used)


def boundary_forgetting_waiting_grads(state: GradState, *, config: Config) -> tuple[GradState, tuple]:
    """At stages 0 and 1 the boundary reduces nothing: the grads that waited whole in
    param.grad through the window are never reduced."""
    return state, ()


def read_not_borrowing(st: Lifecycle, *read: object, config: Config, **fields: object) -> tuple[Lifecycle, tuple]:
    """A param read off another module's _parameters is not registered on the reader: the
    reader computes with a param nobody gathered. (It takes the read whatever its form: the
    Read record, or its fields.)"""
    return st, ()


class Planted(NamedTuple):
    target: str  # the function of fz3 it replaces, "module:function"
    replacement: str  # "module:function", as --patch takes it
    machine: str  # the machine of `python -m fz3 verify` that catches it
    caught: str  # a regular expression the failure's message matches
    lifecycle: str  # for the hunt's table

    @property
    def patch(self) -> str:
        """The --patch argument."""
        return f"{self.target}={self.replacement}"


PLANTED = {
    "release": Planted("fz3.core.param.release:release_into", "fz3.testing.planted:release_ignoring_other_users",
                       "params", "used by an active module|held by gathered_parameters", "param lifecycle"),
    "boundary": Planted("fz3.core.grad.grads:flush_waiting", "fz3.testing.planted:boundary_forgetting_waiting_grads",
                        "grads", "I3|reduced", "grad lifecycle"),
    "read": Planted("fz3.core.calls:read", "fz3.testing.planted:read_not_borrowing",
                    "calls", r"naive model: after Read.* has externals|I5 in forward", "module calls"),
}
