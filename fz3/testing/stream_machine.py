"""The three streams of an accelerator's step as a Hypothesis machine ([Note: streams as
effects], fz3/core/streams.py).

The module-call machine (calls_machine.py) drives the real core through drawn passes: forwards,
complete and partial backwards, steps, zero_grad, accumulation. Every effect it gets back goes
here through a simulated interpreter of the streams, `StreamSim`, built as the real one
(fz3/interpreters/dist.py): it asks fz3/core/streams.py for the ops of each gather, wait,
refresh and reduce, defers a bucket's writes and drops while its reduce is pending, and runs
the ops on a model of the three streams: a vector clock per stream, an event a clock's copy,
a wait a merge. The model's own work on compute:

    forward of module m    after its Enter: reads ("full", p) of its params
    backward of module m   at its PreBackwardRan: reads ("full", p), writes ("grad", p)
    CopyToBucket           reads the grad, writes ("bucket", b)
    WritePartition         reads ("out", b), writes ("partitions",)
    ZeroPartitions, AverageGrads   write ("partitions",)
    StepOptimizer          reads ("partitions",), writes ("shards",), which every gather reads

Checked at every op, each a property of the issue:

    a read happens after the last write of its buffer (no read of a gathered buffer before its
        wait, no reduced output read before its reduce's wait), and a write after every access
        before it;
    a buffer let go (Release) was last touched by a side stream before compute's clock: no
        buffer reused or freed while a stream may still read it (the caching allocator hands
        freed memory to the next allocation on compute);
    the epilogue (AverageGrads) after every reduce launched so far.

Reuse: `TestStreams = StreamMachine.TestCase`; property_tests/test_stream_machine.py plants
reorderings in fz3/core/streams.py and checks the machine catches each.
"""
from __future__ import annotations

from collections import defaultdict

from hypothesis import note
from hypothesis.stateful import initialize

from fz3.core import streams
from fz3.core.effects import (AllGather, AverageGrads, ClearGrads, CopyToBucket, DropGrads, Free, FreePartitions,
                              HoldGrad, ReduceBucket, Refresh, Wait, WaitReduce, WritePartition, ZeroPartitions)
from fz3.core.events import Enter, PreBackwardRan
from fz3.core.hook_effects import StepOptimizer
from fz3.testing.call_cases import call_cases
from fz3.testing.calls_machine import CallsMachine
from fz3.testing.coverage import covered

C, G, R = streams.C, streams.G, streams.R


class StreamOrderError(AssertionError):
    """Two accesses of a buffer on different streams that nothing orders."""


class Clocks:
    """Vector clocks of the three streams, and each buffer's accesses since it was allocated."""

    def __init__(self) -> None:
        self.clock = {s: {C: 0, G: 0, R: 0} for s in (C, G, R)}
        self.events: dict[int, dict[str, int]] = {}
        self.access: dict[tuple, list[tuple[str, str, dict, str]]] = defaultdict(list)  # kind, stream, stamp, what
        self.reduce_stamps: list[dict] = []

    def _before(self, stamp: dict, stream: str, now: dict) -> bool:
        return stamp[stream] <= now[stream]

    def run(self, op) -> None:
        match op:
            case streams.Record(stream=s, event=e):
                self.events[e] = dict(self.clock[s])
            case streams.WaitEvent(stream=s, event=e):
                got = self.events[e]
                self.clock[s] = {k: max(v, got[k]) for k, v in self.clock[s].items()}
            case streams.Launch(stream=s, what=what, reads=reads, writes=writes):
                self.launch(s, what, reads, writes)
            case streams.Release(buffer=b):
                now = self.clock[C]
                for kind, s, stamp, what in self.access.pop(b, ()):
                    if s != C and not self._before(stamp, s, now):
                        raise StreamOrderError(f"{b} let go while the {s} stream may still {kind} it ({what}): "
                                               "compute never waited for that")
                covered("stream order", "buffer let go after every stream's use")

    def launch(self, s: str, what: str, reads: tuple, writes: tuple) -> None:
        self.clock[s][s] += 1
        stamp = dict(self.clock[s])
        for b in reads:
            for kind, s2, st2, what2 in self.access[b]:
                if kind == "write" and not self._before(st2, s2, stamp):
                    raise StreamOrderError(f"{what} on the {s} stream reads {b} before {what2} on the {s2} stream "
                                           "wrote it: no event orders them")
        for b in writes:
            for kind, s2, st2, what2 in self.access[b]:
                if not self._before(st2, s2, stamp):
                    raise StreamOrderError(f"{what} on the {s} stream writes {b} while {what2} on the {s2} stream "
                                           f"may still {kind} it")
        for b in writes:
            self.access[b] = [("write", s, stamp, what)]
        for b in reads:
            self.access[b].append(("read", s, stamp, what))
        if s == R:
            self.reduce_stamps.append(stamp)
        if reads or writes:
            covered("stream order", f"{what.split(' of module')[0]} on the {s} stream ordered")

    def epilogue(self) -> None:
        now = self.clock[C]
        for stamp in self.reduce_stamps:
            if not self._before(stamp, R, now):
                raise StreamOrderError("the epilogue (AverageGrads) runs before a reduce it follows completed")
        self.reduce_stamps = []
        covered("stream order", "epilogue after every reduce")


class StreamSim:
    """The streams of one rank, driven as fz3/interpreters/dist.py drives them."""

    def __init__(self, spec) -> None:
        self.spec = spec
        self.st = streams.Streams()
        self.clocks = Clocks()
        self.deferred: dict[int, list] = defaultdict(list)  # bucket -> effects waiting for its reduce
        self.held: dict[int, list[int]] = {}  # bucket -> params whose grads it reads where they lie

    def hold(self, b: int, p: int) -> None:
        """p's grad now belongs to bucket b's reduce (param.grad = None): a new grad of p is
        another tensor."""
        self.held.setdefault(b, []).append(p)
        self.clocks.access[("held", b, p)] = self.clocks.access.pop(("grad", p), [])

    def ops(self, ops) -> None:
        for op in ops:
            if type(op) is streams.Completed:
                for e in self.deferred.pop(op.bucket, []):
                    self.effect(e)
                covered("stream order", "a reduce's writes and drops after its Completed")
            else:
                self.clocks.run(op)

    def compute(self, what: str, reads=(), writes=()) -> None:
        self.clocks.launch(C, what, tuple(reads), tuple(writes))

    def effect(self, e) -> None:
        match e:
            case AllGather(handle=h, params=ps):
                self.st, ops = streams.gather(self.st, h, ps)
                self.ops(ops)
            case Wait(handle=h):
                self.st, ops = streams.gathered(self.st, h)
                self.ops(ops)
            case Free(params=ps):
                self.ops(streams.freed(ps))
            case Refresh(params=ps):
                self.st, ops = streams.refresh(self.st, ps)
                self.ops(ops)
            case CopyToBucket(bucket=b, param=p):
                self.compute("copy to bucket", (("grad", p),), (("bucket", b),))
                self.ops((streams.Release(("grad", p)),))  # param.grad = None
            case HoldGrad(bucket=b, param=p):
                self.hold(b, p)
            case ReduceBucket(bucket=b, slots=slots, contiguous=contiguous):
                if not contiguous:  # the reduce takes param.grad itself ([Note: grads taken at the reduce])
                    for slot in slots:
                        self.hold(b, slot.param)
                reads = tuple(("held", b, p) for p in self.held[b]) if b in self.held else (("bucket", b),)
                self.st, ops = streams.reduce(self.st, b, reads)
                self.ops(ops)
            case WritePartition(bucket=b) | DropGrads(bucket=b) if streams.pending(self.st, b):
                self.deferred[b].append(e)
            case WritePartition(bucket=b):
                self.compute("write partition", (("out", b),), (("partitions",),))
            case DropGrads(bucket=b):
                self.ops(tuple(streams.Release(("held", b, p)) for p in self.held.pop(b, [])) +
                         (streams.Release(("bucket", b)), streams.Release(("out", b))))
            case WaitReduce():
                self.st, ops = streams.complete_all(self.st)
                self.ops(ops)
            case ZeroPartitions():
                self.compute("zero partitions", (), (("partitions",),))
            case AverageGrads():
                self.clocks.epilogue()
                self.compute("average grads", (("partitions",),), (("partitions",),))
            case FreePartitions():
                self.ops((streams.Release(("partitions",)),))
            case ClearGrads(params=ps):
                self.ops(tuple(streams.Release(("grad", p)) for p in ps))
            case StepOptimizer():
                self.compute("optimizer step", (("partitions",),), (("shards",),))

    def event(self, event, effects) -> None:
        for e in effects:
            self.effect(e)
        match event:
            case Enter(module=m):
                ps = self.spec.modules[m].params
                if ps:
                    self.compute(f"forward of module {m}", tuple(("full", p) for p in ps))
            case PreBackwardRan(module=m):
                ps = self.spec.modules[m].params
                if ps:
                    self.compute(f"backward of module {m}", tuple(("full", p) for p in ps),
                                 tuple(("grad", p) for p in ps))


class StreamMachine(CallsMachine):
    """The module-call machine's passes, each event's effects through StreamSim."""

    @initialize(case=call_cases())
    def setup(self, case) -> None:
        note(f"case: {case}")
        self.start(case)
        covered("examples", "streams")

    def start(self, case) -> None:
        super().start(case)
        self.streams = StreamSim(case.model.spec(case.config))

    def fire(self, event) -> tuple:
        effects = super().fire(event)
        self.streams.event(event, effects)
        return effects
