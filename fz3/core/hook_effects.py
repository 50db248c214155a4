"""The effects the shell's hooks run themselves: on autograd and on the tensor store.

The parameter and gradient effects (effects.py) go to the interpreter. These need what only the
hook that got the event holds: the call's input or output tensors, autograd's engine, the
saved-tensor hooks. fz3/core/calls.py decides when each is due; fz3/shell/engine.py runs them,
in order, between the interpreter's.

    BeginPass         the root's pre-forward: a new pass (the store's grad placeholders go, the
                      saved-param log restarts, the inputs are cast to the compute dtype)
    EndPass           the root's post-forward outside backward: the saved-tensor hooks close
    WrapInputs(m)     pass the call's grad-requiring inputs through one PostBackward node
    WrapOutputs(m)    pass its grad-requiring outputs through one PreBackward node
    GradDue(ps)       these params are freed before autograd accumulates their grads: keep
                      their shape over a placeholder until then (store.grad_due)
    GradIn(p)         p's grad was accumulated: its placeholder, if any, goes
    ClearGradDue      the backward is over (or never came): no placeholder stays
    ZeroGrads(ps)     these params (a leaf's own, whose .grad is None: experts that saw no token
                      on this rank) get zero grads, so every rank reduces the same set
    QueueEndOfBackward  ask autograd to call end_of_backward when this backward is done
                      (queue_callback; once per backward)
    EndOfBackward     the interpreter's pool may let its buffers go until the next pass
    StepOptimizer(no_grad, guarded)  at the boundary, the norm finite: the optimizer steps on the
                      averaged partitions (clipped), the params of no_grad with no grad (None):
                      no grad reached them in the window ([Note: no grad, no step], epilogue.py);
                      the compute shards follow the masters. `guarded`: the norm left to the
                      device, whose flag the optimizer takes ([Note: the verdict on the device])
    SkipStep(step)    at the boundary, the norm not finite: no optimizer step; the shell names
                      the first param whose grad is not finite ([Note: a step skipped])
"""
from __future__ import annotations

from typing import NamedTuple

from fz3.core.effects import record
from fz3.core.ids import ModuleId, ParamId


@record
class BeginPass(NamedTuple):
    """A forward pass starts at the root (not a recompute inside backward)."""


@record
class EndPass(NamedTuple):
    """The root's forward ended outside backward."""


@record
class WrapInputs(NamedTuple):
    module: ModuleId


@record
class WrapOutputs(NamedTuple):
    module: ModuleId


@record
class GradDue(NamedTuple):
    params: tuple[ParamId, ...]


@record
class GradIn(NamedTuple):
    param: ParamId


@record
class ClearGradDue(NamedTuple):
    pass


@record
class ZeroGrads(NamedTuple):
    params: tuple[ParamId, ...]


@record
class QueueEndOfBackward(NamedTuple):
    pass


@record
class EndOfBackward(NamedTuple):
    pass


@record
class StepOptimizer(NamedTuple):
    no_grad: tuple[ParamId, ...]  # trainable params left without a grad (None) for this step
    guarded: bool = False  # the norm unread: the optimizer takes its flag and skips on the device


@record
class SkipStep(NamedTuple):
    step: int  # the optimizer step skipped, counting from 1 (windows closed before it + 1)


HOOK_EFFECTS = (BeginPass, EndPass, WrapInputs, WrapOutputs, GradDue, GradIn, ClearGradDue,
                ZeroGrads, QueueEndOfBackward, EndOfBackward, StepOptimizer, SkipStep)
