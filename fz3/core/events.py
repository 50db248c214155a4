"""Events: what the shell reports to the core, as records, and the one function that takes them.

    update(state, event, *, config) -> (state, effects)

The effects (effects.py, hook_effects.py) are records of the work to do; the events are records
of what happened: the engine builds one per torch hook, passes it to `update` and runs what
comes back (fz3/shell/engine.py). Like the effects they print as Python that rebuilds them, so
a run's event log is data: it replays through `update` to the same effects
(tests/test_events.py), and a failing Hypothesis machine prints its events as a regression
test to paste (fz3/testing/calls_machine.py).

    torch's events, one per hook (fz3/core/calls.py decides each)
    Enter(module, grad, grad_inputs, ...)   pre-forward of a call
    Read(owner, param, grad)                a call read a param off another module's _parameters
    Leave(module, grad_outputs, ...)        post-forward of the call on top of the stack
    Raised(module, recomputing)             the forward of that call raised
    PreBackwardRan(module)                  grads reached a call's outputs (its PreBackward node)
    PostBackwardRan(module, with_grad)      a call's input grads are done (its PostBackward node)
    GradReady(param, dtype, graph_task)     autograd accumulated a param's grad
    BackwardEnded(with_grad)                autograd finished the backward (queue_callback)
    StepCalled(boundary, loss_scale)        the user called step() (set_gradient_accumulation_
                                            boundary's override, or None; fp16's loss scale)
    GradsZeroed()                           the user called zero_grad() (the engine's, the
                                            model's or the optimizer's)
    Stepped(finite, leaf_grads)             the accumulation boundary, the grad norm known (or left to the device)

    what fz3's own features report (the param and grad lifecycles' own transitions)
    Hold(params)                            gathered_parameters opened: the params stay whole
    Unhold(params, stale)                   ... closed; `stale`: their values were rewritten
    ShardsReplaced()                        the shards were written outside a step
                                            (load_weights): every full param is stale
    Resumed(window, backward, skipped, micro_step)
                                            a checkpoint was loaded: the grad lifecycle starts
                                            again at its counters, and the shards are new

Each event is one record with one field list, built by keyword (`Enter(module=m, grad=True,
grad_inputs=False)`), and the step that `update` calls for it takes the record and reads its
fields by name, so no position is bound at either end. The functions `update` calls are looked
up on their modules when it runs, so a test may replace one (property_tests/test_calls_teeth.py
does).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

from fz3.config.config import Config
from fz3.core import calls
from fz3.core.grad import grads
from fz3.core.param import hold, step
from fz3.core.calls import Lifecycle
from fz3.core.effects import record
from fz3.core.ids import ModuleId, ParamId
from fz3.core.pvec import Log


@record
class Enter(NamedTuple):
    module: ModuleId
    grad: bool  # grad mode is on
    grad_inputs: bool  # some input needs grad
    recomputing: bool = False  # autograd is running a backward (a checkpointed region's recompute)
    training: bool = True  # the module's train mode (read at the root)
    saved: int = -1  # the saved-param log's length now (-1: none is kept)


@record
class Read(NamedTuple):
    owner: ModuleId  # the module whose _parameters the param was read off
    param: ParamId
    grad: bool = True  # grad mode is on


@record
class Leave(NamedTuple):
    module: ModuleId
    grad_outputs: bool  # some output needs grad (grad mode on)
    returned: tuple[ParamId, ...] = ()  # params among its outputs (borrowed by the caller)
    saved: Optional[Log] = None  # the pass's saved-param log
    recomputing: bool = False


@record
class Raised(NamedTuple):
    module: ModuleId
    recomputing: bool = False


@record
class PreBackwardRan(NamedTuple):
    module: ModuleId


@record
class PostBackwardRan(NamedTuple):
    module: ModuleId
    with_grad: frozenset = frozenset()  # of a leaf's own params, those whose .grad is set


@record
class GradReady(NamedTuple):
    param: ParamId
    dtype: str  # the grad's dtype name ("float32", "bfloat16")
    graph_task: int = 0  # autograd's graph task that accumulated it


@record
class BackwardEnded(NamedTuple):
    with_grad: frozenset = frozenset()  # the leaves' own params whose .grad is set


@record
class StepCalled(NamedTuple):
    boundary: Optional[bool] = None  # set_gradient_accumulation_boundary's override; None: the count
    loss_scale: float = 1.0  # fp16: the scale the boundary unscales by (scaler.py unscale_by)


@record
class GradsZeroed(NamedTuple):
    pass


@record
class Stepped(NamedTuple):
    finite: Optional[bool] = True  # the global grad norm is finite (on every rank alike); None: the
    # device decides, the step taken with its flag ([Note: the verdict on the device], grad/verdict.py)
    leaf_grads: Optional[frozenset] = None  # leaf params that got a grad on some rank; None: this rank's


@record
class Hold(NamedTuple):
    params: tuple[ParamId, ...]


@record
class Unhold(NamedTuple):
    params: tuple[ParamId, ...]
    stale: bool = True  # the full values may have been edited, or the shards rewritten


@record
class ShardsReplaced(NamedTuple):
    pass


@record
class Resumed(NamedTuple):
    window: int  # accumulation windows closed (skipped ones too)
    backward: int  # backwards run
    skipped: int = 0  # windows whose step was skipped
    micro_step: int = 0  # the engine's place in its cycle of step() calls (kept by a load)


TORCH_EVENTS = (Enter, Read, Leave, Raised, PreBackwardRan, PostBackwardRan, GradReady, BackwardEnded, StepCalled,
                GradsZeroed, Stepped)
EVENTS = TORCH_EVENTS + (Hold, Unhold, ShardsReplaced, Resumed)


def update(st: Lifecycle, event, *, config: Config) -> tuple[Lifecycle, tuple]:
    """The state after `event`, and the effects to run for it, in order."""
    match event:
        case Enter():
            return calls.enter(st, event, config=config)
        case Read():
            return calls.read(st, event, config=config)
        case Leave():
            return calls.leave(st, event, config=config)
        case Raised():
            return calls.raised(st, event, config=config)
        case PreBackwardRan():
            return calls.pre_backward(st, event, config=config)
        case PostBackwardRan():
            return calls.post_backward(st, event, config=config)
        case GradReady():
            return calls.grad_ready(st, event, config=config)
        case BackwardEnded():
            return calls.end_of_backward(st, event, config=config)
        case StepCalled():
            return calls.step_called(st, event, config=config)
        case GradsZeroed():
            return calls.zero_grad(st, event, config=config)
        case Stepped():
            return calls.stepped(st, event, config=config)
        case Hold():
            params, effects = hold.hold(st.params, event.params, config=config)
            return st._replace(params=params), effects
        case Unhold():
            return calls.hold_ended(st, event, config=config)
        case ShardsReplaced():
            params, effects = step.end_of_step(st.params, config=config)
            return st._replace(params=params), effects
        case Resumed():
            params, effects = step.end_of_step(st.params, config=config)
            return Lifecycle(params, grads.resumed(st.grads, window=event.window, backward=event.backward,
                                                   skipped=event.skipped, micro_step=event.micro_step),
                             st.calls), effects
    raise TypeError(f"fz3: update takes one of the events of fz3/core/events.py "
                    f"({', '.join(e.__name__ for e in EVENTS)}), got {event!r}")
