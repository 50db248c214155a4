"""fz3.timeline: what a run did, as one Chrome trace-event JSON file (Perfetto, chrome://tracing).

    with fz3.timeline(engine, "run.json"):      # every rank enters it; rank 0 writes the file
        for x, y in batches: ...
    python -m fz3 timeline run.json run.png      # the same, drawn with matplotlib

One process per rank (pid = rank), three lanes each:

    compute        each module's forward (its pre-forward hook to its forward hook) and backward
                   (the core's PreBackwardRan to the event that ends it: its PostBackwardRan,
                   or the GradReady that releases it), named by module
    communication  each all-gather from issue to the end of its wait; each reduce from issue to
                   completion (the interpreter's deferred completion, or the effect itself)
    core           each core event (fz3/core/events.py: Enter, Leave, PreBackwardRan, GradReady,
                   BackwardEnded, Stepped, ...; a Read only when it borrows), named by its type,
                   its own time only

and a counter track per rank, "live bytes": the core's live params (gathered or in flight) times
the compute dtype's size, after each event. Times are microseconds from a barrier
at the block's start, on each rank's monotonic clock (one host: the same clock).

Off costs nothing: entering the block puts timing wrappers on this engine's instance (its core
door `engine.update`, its interpreter's run, its modules' hooks) and leaving removes them, so no
code path asks whether a timeline is on. On: bench/diagnostics/timeline_overhead.py measures it.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Iterator

import torch.distributed as dist

from fz3.core import replay
from fz3.core.effects import AllGather, ReduceBucket, Refresh, Wait
from fz3.core.events import GradReady, PostBackwardRan, PreBackwardRan, Read

COMPUTE, COMM, CORE = 1, 2, 3
LANES = {COMPUTE: "compute", COMM: "communication", CORE: "core"}


class TimelineError(ValueError):
    """The timeline cannot be written where asked."""


class Recorder:
    """One rank's events, in trace-event form, while the block runs."""

    def __init__(self, engine, t0: int) -> None:
        self.engine, self.t0, self.rank = engine, t0, engine.rank
        self.events: list[dict] = []
        self.open_gathers: dict[int, tuple] = {}  # handle -> (start ns, bytes, prefetch, params)
        self.open_reduces: dict[int, int] = {}  # bucket -> start ns
        self.forward_start: dict[int, list[int]] = {}  # module -> start ns of its open calls
        self.backward_start: dict[int, list[int]] = {}
        self.elem = engine.store.dtype.itemsize
        self.undo: list = []

    def us(self, ns: int) -> float:
        return (ns - self.t0) / 1000.0

    def span(self, lane: int, name: str, start: int, end: int, **args) -> None:
        ev = {"ph": "X", "pid": self.rank, "tid": lane, "name": name, "ts": self.us(start),
              "dur": max(0.0, (end - start) / 1000.0)}
        if args:
            ev["args"] = args
        self.events.append(ev)

    def live(self, ns: int, numel: int) -> None:
        self.events.append({"ph": "C", "pid": self.rank, "name": "live bytes", "ts": self.us(ns),
                            "args": {"live bytes": numel * self.elem}})

    # ---- installing and removing the wrappers ---------------------------------------------------

    def install(self) -> None:
        e = self.engine
        names = e.tables.module_names
        self._wrap(e, "update", self._update(e.update))
        self._wrap(e.interp, "run", self._run(e.interp.run))
        self._wrap(e.interp, "_complete_oldest", self._complete(e.interp))  # DistInterpreter's
        for m, module in enumerate(e.tables.modules):
            name = names[m] or "<root>"
            pre = module.register_forward_pre_hook(self._forward_begin(m))
            post = module.register_forward_hook(self._forward_end(m, name), always_call=True)
            self.undo += [pre.remove, post.remove]
        self.live(time.perf_counter_ns(), e.params_state.live_numel)

    def remove(self) -> None:
        for undo in reversed(self.undo):
            undo()
        self.undo.clear()

    def _wrap(self, obj, attr: str, fn) -> None:
        had = attr in vars(obj)
        old = vars(obj).get(attr)
        setattr(obj, attr, fn)
        self.undo.append((lambda: setattr(obj, attr, old)) if had else (lambda: delattr(obj, attr)))

    # ---- the wrappers -----------------------------------------------------------------------------

    def _update(self, inner):
        """The core's door, timed: each event's transition on the core lane (by its type), the
        live bytes after it, and a module's backward from its PreBackwardRan to the event
        that ends it on the compute lane."""
        names = self.engine.tables.module_names

        def timed(state, event, *, config):
            start = time.perf_counter_ns()
            if type(event) is PreBackwardRan:
                self.backward_start.setdefault(event.module, []).append(start)
            new, effects = inner(state, event, config=config)
            end = time.perf_counter_ns()
            if effects or type(event) is not Read:  # a param read that borrows nothing: no span
                self.span(CORE, type(event).__name__, start, end)
            # a call's backward ends where the core ends it: at its PostBackwardRan, or at the
            # grad that releases it ([Note: released by its grads], fz3/core/calls.py)
            if type(event) is PostBackwardRan or type(event) is GradReady:
                was, now = replay.view(state).params, replay.view(new).params
                for m, starts in self.backward_start.items():
                    for _ in range(min(len(starts), was.grads_remaining(m) - now.grads_remaining(m))):
                        self.span(COMPUTE, f"{names[m] or '<root>'} backward", starts.pop(), end)
            self.live(end, replay.view(new).params.live_numel)
            return new, effects
        return timed

    def _run(self, inner):
        spec = self.engine.spec

        def run(effects) -> None:
            for e in effects:
                start = time.perf_counter_ns()
                inner((e,))
                end = time.perf_counter_ns()
                if isinstance(e, AllGather):
                    nbytes = sum(spec.params[p].numel for p in e.params) * self.elem
                    self.open_gathers[e.handle] = (start, nbytes, e.prefetch, len(e.params))
                elif isinstance(e, Wait) and e.handle in self.open_gathers:
                    begin, nbytes, prefetch, n = self.open_gathers.pop(e.handle)
                    self.span(COMM, "all-gather (prefetch)" if prefetch else "all-gather", begin, end,
                              bytes=nbytes, params=n, wait_us=(end - start) / 1000.0)
                elif isinstance(e, Refresh):  # gathered and waited in one effect
                    nbytes = sum(spec.params[p].numel for p in e.params) * self.elem
                    self.span(COMM, "all-gather (refresh)", start, end, bytes=nbytes, params=len(e.params),
                              wait_us=(end - start) / 1000.0)
                elif isinstance(e, ReduceBucket):
                    self.open_reduces[e.bucket] = start
                    if not self.engine.interp.reduces:  # none in flight: it is done
                        self.span(COMM, "reduce", self.open_reduces.pop(e.bucket), end, slots=len(e.slots))
        return run

    def _complete(self, interp):
        inner = type(interp)._complete_oldest

        def complete() -> None:
            bucket = interp.reduces[0][0]
            inner(interp)
            start = self.open_reduces.pop(bucket, None)
            if start is not None:
                self.span(COMM, "reduce", start, time.perf_counter_ns())
        return complete

    def _forward_begin(self, m: int):
        def hook(module, args) -> None:
            self.forward_start.setdefault(m, []).append(time.perf_counter_ns())
        return hook

    def _forward_end(self, m: int, name: str):
        def hook(module, args, output) -> None:
            starts = self.forward_start.get(m)
            if starts:
                self.span(COMPUTE, f"{name} forward", starts.pop(), time.perf_counter_ns())
        return hook


@contextlib.contextmanager
def timeline(engine, path: str) -> Iterator[None]:
    """Record what `engine` does inside the block on every rank; rank 0 writes `path` at the end
    (every rank must enter the block, as for any collective)."""
    _check_path(path)
    group = getattr(engine.transport, "group", None) if dist.is_initialized() else None  # TorchTransport's
    if dist.is_initialized():
        dist.barrier(group=group)
    rec = Recorder(engine, time.perf_counter_ns())
    rec.install()
    try:
        yield
    finally:
        rec.remove()
    events = [rec.events]
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        events = [None] * dist.get_world_size(group)
        dist.all_gather_object(events, rec.events, group=group)
    if engine.rank == 0:
        write(path, events)


def write(path: str, per_rank: list[list[dict]]) -> None:
    meta = []
    for r in range(len(per_rank)):
        meta.append({"ph": "M", "pid": r, "name": "process_name", "args": {"name": f"rank {r}"}})
        meta.append({"ph": "M", "pid": r, "name": "process_sort_index", "args": {"sort_index": r}})
        for tid, lane in LANES.items():
            meta.append({"ph": "M", "pid": r, "tid": tid, "name": "thread_name", "args": {"name": lane}})
    with open(path, "w") as f:
        json.dump({"traceEvents": meta + [e for events in per_rank for e in events],
                   "displayTimeUnit": "ms", "otherData": {"producer": "fz3.timeline"}}, f)


def _check_path(path: str) -> None:
    if not isinstance(path, (str, os.PathLike)):
        raise TimelineError(f"fz3.timeline: path must be a file name, got {type(path).__name__}")
    folder = os.path.dirname(os.path.abspath(path)) or "."
    if os.path.isdir(path):
        raise TimelineError(f"fz3.timeline: {path!r} is a directory; give a file name such as run.json")
    if not os.path.isdir(folder):
        raise TimelineError(f"fz3.timeline: cannot write {path!r}: the folder {folder!r} does not exist")
    if not os.access(folder, os.W_OK):
        raise TimelineError(f"fz3.timeline: cannot write {path!r}: the folder {folder!r} is not writable")
