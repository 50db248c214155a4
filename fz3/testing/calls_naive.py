"""A deliberately naive model of the module-call decisions, held against fz3/core/calls.py.

Plain sets and lists, written from the design's words (fz3/core/calls.py's Notes), not from its
code: no tables, no frames with log offsets, no waiting records. For each event it says which
hook effects the core must return, in order (ZeroGrads aside: when a leaf is reduced is checked
by the grad reports, fz3/testing/calls_machine.py), and it keeps the externals each module must
have.

    inert        not the root, not a leaf, and every own param persistent (numel <=
                 param_persistence_threshold), or none at all: its calls get no autograd nodes
    enter        the root: BeginPass. Grad on, inputs need grad, not inert, and some own param
                 frozen, or in another module, or borrowed by one, or none, or a leaf:
                 WrapInputs
    waiting      grad on, inputs not wrapped, not a leaf, not inert, some own param trainable:
                 the call is released by its params' grads (with grad inputs too, when every
                 own param is trainable)
    reads none   a waiting call that began while a root forward watched the saves (the root's
                 own call begins before they are watched) and saved none of its unit's params:
                 GradDue(its trainable own params) at its leave, and no PreBackward node
    leave        reads none: GradDue. Outputs need grad, not reads none, not inert or the
                 outermost call: WrapOutputs. The root: EndPass
    raised       the root: EndPass
    externals    a param a call returns is its caller's, a param a call reads off another
                 module's _parameters is the reader's, unless they own it
    backward     the first backward event of a backward: QueueEndOfBackward; GradReady(p):
                 GradIn(p); BackwardEnded: ClearGradDue ... EndOfBackward
    step         the norm finite: StepOptimizer naming every trainable param that got no grad in
                 the window (`got`: the machine adds each backward's contributions); else
                 SkipStep(the window's number, from 1)
"""
from __future__ import annotations

from dataclasses import dataclass, field

from fz3.core.events import (BackwardEnded, Enter, GradReady, GradsZeroed, Leave, PostBackwardRan, PreBackwardRan,
                             Raised, Read, StepCalled, Stepped)
from fz3.core.hook_effects import (BeginPass, ClearGradDue, EndOfBackward, EndPass, GradDue, GradIn,
                                   QueueEndOfBackward, SkipStep, StepOptimizer, WrapInputs, WrapOutputs)
from fz3.core.spec import ModelSpec


@dataclass
class _Open:
    module: int
    may_read_none: bool  # waiting, and its saves are watched
    saved: set[int] = field(default_factory=set)  # params logged as saved since it began


class NaiveCalls:
    def __init__(self, spec: ModelSpec, trainable: tuple[bool, ...], threshold: int) -> None:
        self.own = [frozenset(ms.params) for ms in spec.modules]
        self.leaf = [ms.is_leaf for ms in spec.modules]
        persistent = [ps.numel <= threshold for ps in spec.params]
        self.inert = [m > 0 and not self.leaf[m] and all(persistent[p] for p in self.own[m])
                      for m in range(len(self.own))]
        self.trainable = trainable
        self.homes = [sum(p in own for own in self.own) for p in range(len(spec.params))]
        self.externals: list[set[int]] = [set() for _ in self.own]
        self.entered: set[int] = set()  # modules released by their grads called with grad this pass
        self.open: list[_Open] = []
        self.grad_leaves: set[int] = set()  # leaves called with grad in this pass
        self.in_backward = False
        self.got: set[int] = set()  # params that got a grad in this window
        self.windows = 0  # windows closed

    def expect(self, event) -> list:
        """The hook effects (less ZeroGrads) `event` (fz3/core/events.py) must return; updates
        this model."""
        match event:
            case Enter(module=m, grad=grad, grad_inputs=grad_inputs, saved=saved, recomputing=recomputing):
                return self.enter(m, grad=grad, grad_inputs=grad_inputs, saved=saved, recomputing=recomputing)
            case Read(owner=owner, param=p):
                return self.read(owner, p)
            case Leave(module=m, grad_outputs=grad_outputs, returned=returned):
                return self.leave(m, grad_outputs=grad_outputs, returned=returned)
            case Raised(module=m):
                return self.raised(m)
            case PreBackwardRan() | PostBackwardRan():
                return self._backward_event()
            case GradReady(param=p):
                return self._backward_event() + [GradIn(p)]
            case BackwardEnded():
                self.in_backward, self.entered = False, set()
                return [ClearGradDue(), EndOfBackward()]
            case Stepped(finite=finite):
                return self.stepped(finite=finite)
            case StepCalled() | GradsZeroed():
                return []  # the grad lifecycle's alone (its own machine: fz3/testing/grad_machine.py)
        raise TypeError(f"the naive model takes torch's events, not {event!r}")

    def grad_params(self, m: int) -> tuple[int, ...]:
        return tuple(sorted(p for p in self.own[m] if self.trainable[p]))

    def saved(self, params: frozenset[int]) -> None:
        for c in self.open:
            c.saved |= params

    # ---- forward ---------------------------------------------------------------------------------
    def enter(self, m: int, *, grad: bool, grad_inputs: bool, saved: int = -1, recomputing: bool = False) -> list:
        out: list = []
        if m == 0 and not recomputing:
            out.append(BeginPass())
            self.open, self.grad_leaves, self.entered = [], set(), set()
        # released by its grads: every own param trainable (and so hooked: not a leaf, not
        # inert), in no other module and borrowed by none; its first call with grad since the
        # pass began or a backward ended
        borrowed = set().union(*self.externals)
        static = bool(self.own[m]) and not self.leaf[m] and not self.inert[m] and \
            all(self.trainable[p] and self.homes[p] == 1 for p in self.own[m])
        by_grads = static and m not in self.entered and not (self.own[m] & borrowed)
        if grad and static:
            self.entered.add(m)
        wrapped = grad and grad_inputs and not self.inert[m] and not by_grads
        if wrapped:
            out.append(WrapInputs(m))
        waiting = (grad and not wrapped and not self.leaf[m] and not self.inert[m]
                   and bool(self.grad_params(m)))
        if grad and self.leaf[m]:
            self.grad_leaves.add(m)
        self.open.append(_Open(m, waiting and saved >= 0))
        return out

    def read(self, owner: int, p: int) -> list:
        if self.open and self.open[-1].module != owner and p not in self.own[self.open[-1].module]:
            self.externals[self.open[-1].module].add(p)
        return []

    def leave(self, m: int, *, grad_outputs: bool, returned: tuple[int, ...] = ()) -> list:
        call = self.open.pop()
        assert call.module == m, f"naive model: leave of m{m} while m{call.module} is open"
        if returned and self.open:
            caller = self.open[-1].module
            self.externals[caller] |= set(returned) - self.own[caller]
        reads_none = call.may_read_none and not (call.saved & (self.own[m] | self.externals[m]))
        out: list = [GradDue(self.grad_params(m))] if reads_none else []
        if grad_outputs and not reads_none and (not self.inert[m] or not self.open):
            out.append(WrapOutputs(m))
        return out + ([EndPass()] if m == 0 else [])

    def raised(self, m: int) -> list:
        if not self.open or self.open[-1].module != m:
            return []
        self.open.pop()
        return [EndPass()] if m == 0 else []

    # ---- backward --------------------------------------------------------------------------------
    def _backward_event(self) -> list:
        first, self.in_backward = not self.in_backward, True
        return [QueueEndOfBackward()] if first else []

    def stepped(self, *, finite: bool | None = True) -> list:
        got, self.got = self.got, set()
        self.windows += 1
        if finite is False:
            return [SkipStep(self.windows)]
        return [StepOptimizer(tuple(p for p, t in enumerate(self.trainable) if t and p not in got),
                              guarded=finite is None)]
