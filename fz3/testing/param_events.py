"""The parameter machine's events, as records: one per step of fz3's parameter half that the
shell's events come down to (fz3/core/calls.py decides which, fz3/core/events.py is the layer
the engine uses). A drawn pass is a list of them, so a failure prints as Python to paste.

    Fetch(module, grad_inputs)       a call's pre-forward: fetch                (fz3/core/param/fetch.py)
    Compute(module)                  the module computes with its unit (no transition; checked)
    Register(module, params)         params it does not own become its externals (backward.py)
    Release(module, grad_outputs)    a call's post-forward: release             (release.py)
    BackwardFetch(module)            a call's pre-backward: fetch_for_backward  (backward.py)
    BackwardRelease(module)          a call's post-backward: release_after_backward
    Reset(grad_enabled, aborted)     the root's pre-forward: reset_step         (step.py)
    Finish()                         end of backward: finish_backward
    EndOfStep()                      after the optimizer: end_of_step
    HoldParams(params)               gathered_parameters enters: hold            (hold.py)
    UnholdParams(params, stale)      ... and leaves: unhold

Each record's `kind` names it in coverage and in the naive model's checks.
"""
from __future__ import annotations

from typing import NamedTuple

from fz3.config.offload import Aio, OffloadOptimizer, OffloadParam  # noqa: F401 - for the printed regressions
from fz3.core.effects import record


@record
class Fetch(NamedTuple):
    module: int
    grad_inputs: int = 0
    kind = "fetch"


@record
class Compute(NamedTuple):
    module: int
    kind = "compute"


@record
class Register(NamedTuple):
    module: int
    params: tuple[int, ...]
    kind = "external"


@record
class Release(NamedTuple):
    module: int
    grad_outputs: bool = False
    kind = "release"


@record
class BackwardFetch(NamedTuple):
    module: int
    kind = "pre_backward"


@record
class BackwardRelease(NamedTuple):
    module: int
    kind = "post_backward"


@record
class Reset(NamedTuple):
    grad_enabled: bool = True
    aborted: bool = False
    kind = "reset"


@record
class Finish(NamedTuple):
    kind = "finish"


@record
class EndOfStep(NamedTuple):
    kind = "end_of_step"


@record
class HoldParams(NamedTuple):
    params: tuple[int, ...]
    kind = "hold"


@record
class UnholdParams(NamedTuple):
    params: tuple[int, ...]
    stale: bool = True
    kind = "unhold"

