"""Whether a boundary's optimizer step applied, when the device decides it.

[Note: the verdict on the device] At the boundary the global grad norm is a device tensor. Read
on the host, it stops the host until the device has caught up, once a step, so the host can no
longer run ahead of it. torch's fused optimizers (fused=True: Adam, AdamW, SGD, Adagrad) take
the verdict as a tensor instead: `found_inf`, what torch's GradScaler hands them, whose kernel
leaves the params and the whole state (step counts included) as they were where it is 1. With
such an optimizer the engine takes every boundary's step without reading the norm
(Stepped(finite=None): StepOptimizer(guarded=True), fz3/core/calls.py), copies the flag to the
host without waiting, and reads it later, when it has long landed (`read`):

    at the next boundary, before its step, every rank (all read the same bit: the norm is
                        all-reduced)
    when the user asks  was_step_applied(), the skipped count (stats(), optimizer.overflow), a
                        checkpoint's counters: this rank alone

What hangs on the verdict, on the host:

    the lr scheduler    stepped with the optimizer before the verdict is known (`ahead`); a
                        step read as skipped puts it back (PutBackScheduler) before the next
                        step uses its lr, so every applied step runs at the lr a verdict read at
                        once gives it
    the counts          skipped steps and was_step_applied
    the WARNING         naming the step and the first param whose grad is not finite: owed from
                        the read and given at the next boundary (NameSkipped), where every rank
                        is, since finding that param is a collective

fp16's dynamic loss scale moves on the verdict: with it on the device too, the scale, its good
steps and hysteresis are device tensors updated by the flag (fz3/shell/device_scale.py, held
to scaler.update_scale), and its INFO lines, and the LossScaleError of an overflow at the
minimum scale, come with the read, a step late.

Where the optimizer cannot take the flag (torch's foreach and for-loop implementations refuse
it, as does any other optimizer), and where the host needs the verdict at once (offload's step
on the host), the boundary reads it (Stepped(finite=True|False)): one sync a step, which the
engine names once on an accelerator (fz3/shell/log.py).

The machine: fz3/testing/verdict_machine.py, against a run that reads every verdict at once.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

from fz3.core.effects import record


class VerdictError(RuntimeError):
    """A boundary's step taken while the last one's verdict is still unread."""


class Verdict(NamedTuple):
    pending: int = 0  # the step (counting from 1) taken with its verdict on the device, unread; 0: none
    ahead: bool = False  # the lr scheduler was stepped for the pending step
    owed: int = 0  # a step read as skipped whose WARNING is not given yet; 0: none
    skipped: int = 0  # steps whose verdict, read from the device, was: skipped
    applied: bool = False  # the last step whose verdict was read from the device applied


@record
class StepScheduler(NamedTuple):
    """Step the lr scheduler; `undoable`: first keep what PutBackScheduler needs."""
    undoable: bool


@record
class PutBackScheduler(NamedTuple):
    """The pending step was skipped: the lr scheduler goes back to where it was before it."""


@record
class NameSkipped(NamedTuple):
    """Every rank: the WARNING that optimizer step `step` was skipped, naming its first param
    whose grad was not finite (from the flags kept on the device at that step)."""
    step: int


def taken(v: Verdict, *, step: int, finite: Optional[bool], scheduler: bool) -> tuple[Verdict, tuple]:
    """The boundary's optimizer step `step` (counting from 1): `finite` read on the host, or
    None: left to the device. `scheduler`: the engine has an lr scheduler to step."""
    if v.pending:
        raise VerdictError(f"optimizer step {step} taken while step {v.pending}'s verdict was not yet read: "
                           "read it at the boundary, before the step")
    if finite is None:
        return v._replace(pending=step, ahead=scheduler), ((StepScheduler(undoable=True),) if scheduler else ())
    return v, ((StepScheduler(undoable=False),) if finite and scheduler else ())


def read(v: Verdict, finite: Optional[bool], *, every_rank: bool) -> tuple[Verdict, tuple]:
    """The pending step's flag read (`finite`; None: nothing pending, nothing read).
    `every_rank`: every rank reads here (the boundary), so an owed WARNING is given."""
    effects: tuple = ()
    if v.pending:
        if finite is None:
            raise VerdictError(f"step {v.pending}'s verdict is pending: read its flag")
        if not finite and v.ahead:
            effects += (PutBackScheduler(),)
        v = Verdict(owed=v.owed if finite else v.pending, skipped=v.skipped + (not finite), applied=finite)
    if every_rank and v.owed:
        effects += (NameSkipped(v.owed),)
        v = v._replace(owed=0)
    return v, effects
