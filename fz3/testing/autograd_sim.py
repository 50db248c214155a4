"""A small simulation of torch autograd, as fz3's engine experiences it, for drawn programs.

fz3/core/events.py takes torch's events one per hook; this plays torch. It emits the events the
engine's hooks would (fz3/shell/engine.py), runs the hook effects the core returns as the engine
does, and fails where torch would: a backward that reads a freed param, an AccumulateGrad that
finds no shape, an end of backward queued twice or never (SimError).

    forward    Enter / Read / Leave, nested as the program (fz3/testing/models.py) says. A call
               that `saves` logs what it computed with in the saved-param log, while a root
               forward has the saved-tensor hooks open (BeginPass .. EndPass). After each item
               of its body the caller computes with its unit, plus what the items gave it
               (params a child returned, params it read off another module): I5 in forward
    nodes      autograd nodes exist only where the core said: WrapInputs -> a PostBackward node,
               WrapOutputs -> a PreBackward node (per call of this pass)
    backward   the forward calls in reverse, nested (as models.backward_events); for a call whose
               outputs get a grad:
                   its PreBackward node, if any              -> PreBackwardRan(m)
                   one compute per trainable param it used,  externals first, own params last;
                     each accumulated into that param's grad -> GradReady(p) after p's last
                                                                contribution, if p has a hook
                   its children's backwards, last call first
                   one compute more for its input grads      (if its inputs need grad)
                   its PostBackward node, if any             -> PostBackwardRan(m, with_grad:
                                                                the params with a grad so far)
               A compute of a call that saved params finds its unit, and all it used, AVAILABLE
               (I5 in backward)
    quiet      (`quiet=True`, as the engine runs) a call of a quiet module (CallTables.quiet)
               inside another call fires no Enter / Leave / Raised, and no Read is fired for a
               param read off a quiet module's _parameters (the engine does not watch them):
               [Note: inert modules]. Its I5 checks still run: its params must be live without
               its events
    hooks      a trainable param with a hook in the core's CallTables.hooked has a grad hook
               (the engine's _install); the others (a leaf's own, an inert module's alone) have
               none: the core reduces them. A leaf's call computes with its unit less its
               `skips` (experts no token was routed to: no grad)
    end        BackwardEnded(with_grad), if the core queued it: exactly once in a backward
               with any event; in one without, if unhooked params got grads (the engine
               sends it then: after engine.backward, at step() or the next outermost call)
    store      GradDue / GradIn / ClearGradDue / BeginPass keep the store's placeholders: a param
               freed while its grad is due keeps its shape, which AccumulateGrad needs

[Note: own params last] A call whose inputs need no grad reads its own params in backward only
in the nodes that compute their grads, so once those are accumulated its backward is over
(fz3/core/calls.py, [Note: modules without grad inputs]); what it computes for the grads of
params it borrowed reads those, which stay gathered (externals). The simulation orders a call's
computes that way, so its I5 check holds the core to that claim and no stronger one.

[Note: no read after the last grad] Torch runs a param's AccumulateGrad (and its hook) once every
node with an edge to it has run, and a node that reads a trainable param for backward has that
edge: the grad of its input and the grad of the param come from one node (addmm,
native_layer_norm). So the compute for a call's input grads never reads a trainable param whose
grad this backward has already accumulated whole (such a param was not read by it, or was read
before), and the simulation does not check those: a call released at its own grads with grad
inputs ([Note: released by its grads], fz3/core/calls.py) is held to exactly that. A read
through a detached alias, which has no edge, is the engine's saved-tensor watch's to catch.

The driver (fz3/testing/calls_machine.py) runs each event on the core and checks it:
`driver.fire(event) -> effects` (an event record of fz3/core/events.py), `driver.state` (the
Lifecycle now) and
`driver.saved(params)` (what the saved-tensor hooks just logged).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Protocol

from fz3.core.calls import Lifecycle
from fz3.core.effects import ClearGrads, CopyToBucket, DropGrads, Free, HoldGrad
from fz3.core.events import (BackwardEnded, Enter, GradReady, Leave, PostBackwardRan, PreBackwardRan, Raised,
                             Read)
from fz3.core.hook_effects import (BeginPass, ClearGradDue, EndPass, GradDue, GradIn,
                                   QueueEndOfBackward, WrapInputs, WrapOutputs)
from fz3.core.ids import Status
from fz3.core.param.invariants import check_fetched
from fz3.core.pvec import Log
from fz3.core.spec import ModelSpec
from fz3.core.param.state import AVAILABLE, unit_of
from fz3.testing.coverage import covered
from fz3.testing.models import Call, External


class SimError(AssertionError):
    """Torch would fail here (or the engine would hang): the message says what and where."""


class Driver(Protocol):
    state: Lifecycle

    def fire(self, event) -> tuple: ...

    def saved(self, params: frozenset[int]) -> None: ...


@dataclass
class Node:
    """One call of this pass, as autograd knows it."""

    call: Call
    index: int  # pre-order, as models.backward_events' `reached` counts
    children: list["Node"] = field(default_factory=list)
    inputs_node: bool = False  # WrapInputs: a PostBackward node on its inputs
    outputs_node: bool = False  # WrapOutputs: a PreBackward node on its outputs
    used: frozenset[int] = frozenset()  # params it computed with in forward
    quiet: bool = False  # a quiet module's call inside another: it fired no event


class _Raised(Exception):
    """The forward raised (a planned exception): unwind the open calls."""


class AutogradSim:
    """Plays torch for one model; see the module docstring. `avoid`: situations of
    fz3/testing/call_cases.py's KNOWN_GAPS the simulation steers clear of (none of its own)."""

    def __init__(self, spec: ModelSpec, trainable: tuple[bool, ...], driver: Driver, *,
                 avoid: frozenset[str] = frozenset(), quiet: bool = False) -> None:
        self.spec, self.trainable, self.driver, self.avoid = spec, trainable, driver, avoid
        self.hooked = driver.state.calls.tables.hooked  # what the shell hooks: the core says
        self.unhooked = {p for p, (t, h) in enumerate(zip(trainable, self.hooked)) if t and not h}
        self.quiet_modules = driver.state.calls.tables.quiet
        self.quiet = quiet
        self.log: Log[int] = Log()  # the saved-param log (fz3/shell/saved.py)
        self.watching = False  # the saved-tensor hooks are open (a root forward)
        self.due: set[int] = set()  # the store's grad_due
        self.placeholder: set[int] = set()  # freed params that keep their shape
        self.root: Node | None = None  # this pass's calls
        self.stack: list[Node] = []
        self.ticks, self.stop, self.count = 0, None, 0
        self.reached: frozenset[int] | None = None  # this backward's
        self.waiting: set[int] = set()  # modules with calls waiting for their grads
        self.remaining: Counter[int] = Counter()  # contributions still to come, by param
        self.contributed: set[int] = set()  # trainable params that got one
        # params whose .grad is set: a grad in, until the effect that takes it out (copied or held
        # into a bucket, dropped at a reduce that read .grad, cleared); across backwards too (grads
        # waiting for the boundary at stages 0 and 1). What the engine shows the core as with_grad
        self.holding: set[int] = set()
        self.queued = self.events = 0

    # ---- events and hook effects ----------------------------------------------------------------
    def fire(self, event, node: Node | None = None) -> tuple:
        effects = self.driver.fire(event)
        for e in effects:
            self.hook(e, event, node)
        return effects

    def hook(self, e: object, event, node: Node | None) -> None:
        """What the engine does with a hook effect (and the store with a Free)."""
        if isinstance(e, (WrapInputs, WrapOutputs)):
            want = Enter if isinstance(e, WrapInputs) else Leave
            if type(event) is not want or node is None or node.call.module != e.module:
                raise SimError(f"{e} during {event}: the hook has no such tensors to wrap")
            if isinstance(e, WrapInputs):
                node.inputs_node = True
            else:
                node.outputs_node = True
        elif isinstance(e, BeginPass):
            self.log, self.watching = Log(), True
            self.clear_due()
        elif isinstance(e, EndPass):
            self.watching = False
        elif isinstance(e, GradDue):
            self.due.update(e.params)
        elif isinstance(e, GradIn):
            self.grad_in(e.param)
        elif isinstance(e, ClearGradDue):
            self.clear_due()
        elif isinstance(e, QueueEndOfBackward):
            self.queued += 1
        elif isinstance(e, Free):
            for p in e.params:
                (self.placeholder.add if p in self.due else self.placeholder.discard)(p)
        elif isinstance(e, (CopyToBucket, HoldGrad)):
            self.holding.discard(e.param)
        elif isinstance(e, DropGrads) and not e.contiguous or isinstance(e, ClearGrads):
            self.holding.difference_update(e.params)

    def grad_in(self, p: int) -> None:
        self.due.discard(p)
        self.placeholder.discard(p)

    def clear_due(self) -> None:
        for p in list(self.due):
            self.grad_in(p)

    # ---- forward ---------------------------------------------------------------------------------
    def forward(self, call: Call, *, grad: bool, stop: int | None = None) -> bool:
        """One root forward. `stop`: it raises before its stop-th enter or leave (the open calls
        get Raised, innermost first, as the post-forward hooks run while it unwinds).
        -> whether it ran to its end."""
        self.root, self.stack, self.ticks, self.stop, self.count = None, [], 0, stop, 0
        try:
            self._forward(call, grad, None)
        except _Raised:
            for node in reversed(self.stack):
                if not node.quiet:
                    self.fire(Raised(module=node.call.module))
            self.stack = []
            return False
        return True

    def _tick(self) -> None:
        self.ticks += 1
        if self.stop is not None and self.ticks >= self.stop:
            raise _Raised()

    def _forward(self, call: Call, grad: bool, parent: Node | None) -> tuple[int, ...]:
        m, node = call.module, Node(call, self.count)
        self.count += 1
        if parent is None:
            self.root = node
        else:
            parent.children.append(node)
        self._tick()
        node.quiet = self.quiet and self.quiet_modules[m] and bool(self.stack)
        if node.quiet:
            covered("call decisions", "inert call inside another: no event")
        else:
            self.fire(Enter(module=m, grad=grad, grad_inputs=grad and call.grad_inputs == 1, training=grad,
                            saved=len(self.log) if self.watching else -1), node)
        self.stack.append(node)
        if node.quiet:  # no fetch counts it among its params' users: they must be live anyway
            self.compute_forward(m, set(), call)
        else:
            check_fetched(self.driver.state.params, m)  # I5 in forward: the call starts
        got: set[int] = set()
        for item in call.body:
            if isinstance(item, Call):
                got |= set(self._forward(item, grad, node))
            else:
                got |= set(self._read(item))
            self.compute_forward(m, got, item)
        node.used = (frozenset(unit_of(self.driver.state.params, m)) - frozenset(call.skips)) | got
        if grad and call.saves and self.watching:
            self.log = self.log.extend(sorted(node.used))
            self.driver.saved(node.used)
        self._tick()
        if not node.quiet:
            self.fire(Leave(module=m, grad_outputs=grad and self.outputs_grad(call), returned=call.returns,
                            saved=self.log), node)
        self.stack.pop()
        return call.returns

    def _read(self, item: External) -> tuple[int, ...]:
        """The running call reads params off an owner's _parameters: the first owner the engine
        watches (it does not watch leaf modules' _parameters, nor, quiet, quiet modules')."""
        read = []
        for p in item.params:
            owner = next((m for m, ms in enumerate(self.spec.modules) if p in ms.params
                          and not ms.is_leaf), None)
            if owner is not None:
                if not (self.quiet and self.quiet_modules[owner]):
                    self.fire(Read(owner=owner, param=p))
                read.append(p)
        return tuple(read)

    def compute_forward(self, m: int, got: set[int], item: Call | External) -> None:
        """After an item of its body, the caller computes with its unit and what it got."""
        params = self.driver.state.params
        for p in sorted(set(unit_of(params, m)) | got):
            if params.status(p) != AVAILABLE:
                raise SimError(f"I5 in forward: {self._m(m)} computes with {self._p(p)} (of its "
                               f"unit, returned to it or read by it), which is {self._status(p)}")
        covered("I5", "forward compute after a child call" if isinstance(item, Call)
                else "forward compute after reading another module's params")

    def outputs_grad(self, call: Call) -> bool:
        """Its outputs need grad (with grad on): as drawn, or it computes with a trainable own
        param, or returns one (the engine's needs_grad sees the Parameter)."""
        return call.outputs_grad or any(self.trainable[p] for p in
                                        self.spec.modules[call.module].params + call.returns)

    # ---- backward --------------------------------------------------------------------------------
    def backward(self, reached: frozenset[int] | None = None) -> bool:
        """The backward of the last forward; `reached`: pre-order indices of the calls whose
        outputs get a grad (None: all). -> whether the core queued an end of backward."""
        self.remaining, self.contributed, self.reached = Counter(), set(), reached
        self.queued = self.events = 0
        self._walk(self.root, lambda n: self.remaining.update(self.order(n)))
        self._backward(self.root)
        if self.events and self.queued != 1:
            raise SimError(f"end of backward queued {self.queued} times in one backward with "
                           f"{self.events} events (QueueEndOfBackward must come exactly once)")
        if not self.events:
            if self.queued or self.contributed - self.unhooked:
                raise SimError(f"a backward without events queued {self.queued} ends; params "
                               f"{sorted(self.contributed)} got grads")
            if not self.contributed:
                return False
            # only unhooked params got grads: the engine reports them itself before the next event
            covered("call decisions", "a backward without events: the engine ends it")
        else:
            covered("call decisions", "end of backward queued once")
        self.fire(BackwardEnded(with_grad=frozenset(self.holding)))
        if self.due or self.placeholder:
            raise SimError(f"grad placeholders left after the end of backward: {sorted(self.due)}")
        return True

    def hit(self, node: Node) -> bool:
        """Its outputs get a grad."""
        return self.outputs_grad(node.call) and (self.reached is None or node.index in self.reached)

    def order(self, node: Node) -> list[int]:
        """The params a hit call's backward accumulates into, in order ([Note: own params
        last])."""
        if not self.hit(node):
            return []
        own = set(self.spec.modules[node.call.module].params)
        used = [p for p in sorted(node.used, reverse=True) if self.trainable[p]]
        return [p for p in used if p not in own] + [p for p in used if p in own]

    def _walk(self, node: Node, visit: Callable[[Node], object]) -> None:
        visit(node)
        for c in node.children:
            self._walk(c, visit)

    def _backward(self, node: Node) -> None:
        m, hit = node.call.module, self.hit(node)
        if hit and node.outputs_node:
            self.event(PreBackwardRan(module=m))
        for p in self.order(node):
            self.compute_backward(node)
            self.accumulate(p)
        for child in reversed(node.children):
            self._backward(child)
        if hit and node.call.grad_inputs:
            self.compute_backward(node, inputs=True)
        if hit and node.inputs_node:
            self.event(PostBackwardRan(module=m, with_grad=frozenset(self.holding)))

    def event(self, event) -> None:
        self.events += 1
        self.fire(event)

    def compute_backward(self, node: Node, inputs: bool = False) -> None:
        """I5 in backward: a call that saved params reads them (and all it used) again. The
        compute for its input grads (`inputs`) reads no trainable param whose grad this backward
        has accumulated whole ([Note: no read after the last grad])."""
        if not node.call.saves:
            return
        m, params = node.call.module, self.driver.state.params
        done = {p for p in self.contributed if self.remaining[p] == 0} if inputs else set()
        for p in sorted((set(unit_of(params, m)) | node.used) - done):
            if params.status(p) != AVAILABLE:
                raise SimError(f"I5 in backward: {self._m(m)} computes with {self._p(p)}, which "
                               f"is {self._status(p)}")
        covered("I5", "backward compute, " + ("with a PreBackward node" if node.outputs_node
                                              else "no PreBackward node (inert)"))

    def accumulate(self, p: int) -> None:
        """AccumulateGrad for p (it needs p's shape), then p's grad hook at its last one."""
        if self.driver.state.params.status(p) != AVAILABLE:
            if p not in self.placeholder:
                raise SimError(f"AccumulateGrad of {self._p(p)}: it is {self._status(p)} with no "
                               "GradDue placeholder keeping its shape")
            covered("call decisions", "grad accumulated over a GradDue placeholder")
        self.remaining[p] -= 1
        self.contributed.add(p)
        self.holding.add(p)
        if self.remaining[p] == 0 and self.hooked[p]:
            self.event(GradReady(param=p, dtype="float32"))

    # ---- names -----------------------------------------------------------------------------------
    def _m(self, m: int) -> str:
        return f"m{m} ({self.spec.modules[m].name})"

    def _p(self, p: int) -> str:
        return f"p{p} ({self.spec.params[p].name})"

    def _status(self, p: int) -> str:
        return Status(self.driver.state.params.status(p)).name
