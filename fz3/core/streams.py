"""The three streams of an accelerator's step, as effects: which stream each collective runs on,
the events that order them, and when a reduce's output may be read and its inputs let go.

[Note: streams as effects] On an accelerator the gathers and reduces run on side streams while
the model computes (DeepSpeed's overlap_comm; the seed's whole point about it):

    compute (C)  the model's kernels, the optimizer, the partitions' writes, the epilogue
    gather (G)   the all-gathers of params into their full buffers (and the step's refresh)
    reduce (R)   the reduce-scatters of grads

Nothing orders two streams but events. The interpreter (fz3/interpreters/dist.py) runs the ops
these functions return, in order, and decides nothing about streams itself:

    Record(stream, event)                 the event marks what the stream has queued so far
    WaitEvent(stream, event)              the stream runs nothing more until it is reached
    Launch(stream, what, reads, writes)   the collective, on its stream (the buffers are what
                                          the machine checks: ("full", p), ("shards",),
                                          ("grad", p), ("bucket", b), ("out", b))
    Completed(bucket)                     the reduce of `bucket` is over for compute: its output
                                          may be read (WritePartition) and its inputs let go
                                          (DropGrads), which waited for it
    Release(buffer)                       the host lets a buffer go

Where they come:

    gather(st, h, ps)    Record(C) WaitEvent(G) (the shards compute wrote: the optimizer's step)
                         Launch(G, all_gather) Record(G, h's event)
    gathered(st, h)      WaitEvent(C, h's event): the full values may be read, and later freed
    refresh(st, ps)      a gather waited at once (the step's refresh of persistent params)
    freed(ps)            Release(full p)
    reduce(st, b, ...)   the oldest reduce Completed first while `max_reduces` are in flight
                         (WaitEvent(C, its event)), then Record(C) WaitEvent(R) (the grads backward
                         wrote) Launch(R, reduce) Record(R, b's event)
    complete(st, b=None) the oldest reduce, or `b`'s and those before it, Completed (WaitReduce;
                         a bucket buffer wanted again)
    pending(st, b)       whether `b`'s reduce is not Completed yet: its writes and drops wait

Every buffer is allocated on the compute stream, and the caching allocator hands memory freed
on the host to the next allocation on that stream; so a buffer a side stream touched is let go
only after compute waited for that touch: a full value after `gathered`, a reduce's grads,
bucket and output after `Completed`. On NCCL and HCCL a collective runs on the backend's own
stream: the work's wait() orders compute after it (the interpreter calls it before the
WaitEvent); the events order fz3's own copies on G and R. On CPU the streams and events are
inert (fz3/shell/device.py), and the same ops run.

The machine: fz3/testing/stream_machine.py replays drawn passes of the real core through these
functions on a model of the three streams (vector clocks) and checks that no gathered buffer is
read before its gather, none is let go while a stream may still touch it, no reduce's output is
read before its reduce, and the epilogue comes after every reduce of its window.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

from fz3.core.effects import record
from fz3.core.ids import BucketId, Handle, ParamId

C, G, R = "compute", "gather", "reduce"

MAX_REDUCES_IN_FLIGHT = 1
"""A bucket's reduce is issued once the previous one completed (it has had a bucket's worth of
backward to do so). Without a bound every bucket of a backward stayed in flight until its end,
holding its grads and receive scratch: 6 bytes per param per rank on 2 ranks (the p2p
reduce-scatter, which holds the grads rather than a bucket buffer; bench/diagnostics/memory.py fit 14.1
B/param against a theory of 8). DeepSpeed: the reduce stream is synchronized before an IPG
buffer is reused."""


@record
class Record(NamedTuple):
    stream: str
    event: int


@record
class WaitEvent(NamedTuple):
    stream: str
    event: int


@record
class Launch(NamedTuple):
    stream: str
    what: str
    reads: tuple = ()
    writes: tuple = ()


@record
class Completed(NamedTuple):
    bucket: BucketId


@record
class Release(NamedTuple):
    buffer: tuple


class Streams(NamedTuple):
    next_event: int = 0
    gathers: tuple[tuple[Handle, int], ...] = ()  # in flight: handle -> the event G recorded after it
    reduces: tuple[tuple[BucketId, int], ...] = ()  # not Completed, oldest first: bucket -> R's event


class StreamError(RuntimeError):
    """An op the streams cannot order: waiting a gather or a reduce never issued."""


def _side(st: Streams, stream: str, launch: Launch) -> tuple[Streams, int, tuple]:
    """Record(C) WaitEvent(stream) launch Record(stream): -> (state, the last event, ops)."""
    e = st.next_event
    return (st._replace(next_event=e + 2), e + 1,
            (Record(C, e), WaitEvent(stream, e), launch, Record(stream, e + 1)))


def gather(st: Streams, h: Handle, ps: tuple[ParamId, ...]) -> tuple[Streams, tuple]:
    st, done, ops = _side(st, G, Launch(G, "all_gather", (("shards",),), tuple(("full", p) for p in ps)))
    return st._replace(gathers=st.gathers + ((h, done),)), ops


def gathered(st: Streams, h: Handle) -> tuple[Streams, tuple]:
    for i, (handle, e) in enumerate(st.gathers):
        if handle == h:
            return st._replace(gathers=st.gathers[:i] + st.gathers[i + 1:]), (WaitEvent(C, e),)
    raise StreamError(f"gather {h} waited but not in flight (in flight: {[g for g, _ in st.gathers]})")


def refresh(st: Streams, ps: tuple[ParamId, ...]) -> tuple[Streams, tuple]:
    st, done, ops = _side(st, G, Launch(G, "refresh", (("shards",),), tuple(("full", p) for p in ps)))
    return st, ops + (WaitEvent(C, done),)


def freed(ps: tuple[ParamId, ...]) -> tuple:
    return tuple(Release(("full", p)) for p in ps)


def reduce(st: Streams, b: BucketId, reads: tuple = (), *, max_reduces: int = MAX_REDUCES_IN_FLIGHT
           ) -> tuple[Streams, tuple]:
    """The reduce of bucket `b`, reading `reads` (its grads, or its bucket buffer: what the
    stream machine checks; the interpreter has no use for them)."""
    ops: tuple = ()
    while len(st.reduces) >= max_reduces:
        st, done = complete(st)
        ops += done
    st, done, launch = _side(st, R, Launch(R, "reduce", reads, (("out", b),)))
    return st._replace(reduces=st.reduces + ((b, done),)), ops + launch


def complete(st: Streams, b: Optional[BucketId] = None) -> tuple[Streams, tuple]:
    """The oldest reduce Completed (`b`: every reduce up to `b`'s)."""
    if not st.reduces:
        raise StreamError("no reduce in flight to complete")
    if b is not None and all(bucket != b for bucket, _ in st.reduces):
        raise StreamError(f"bucket {b}'s reduce is not in flight")
    ops: tuple = ()
    while st.reduces:
        (bucket, e), st = st.reduces[0], st._replace(reduces=st.reduces[1:])
        ops += (WaitEvent(C, e), Completed(bucket))
        if b is None or bucket == b:
            break
    return st, ops


def complete_all(st: Streams) -> tuple[Streams, tuple]:
    """WaitReduce: every reduce Completed, oldest first."""
    ops: tuple = ()
    while st.reduces:
        st, done = complete(st)
        ops += done
    return st, ops


def pending(st: Streams, b: BucketId) -> bool:
    return any(bucket == b for bucket, _ in st.reduces)
