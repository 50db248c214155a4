"""The interpreter runs the streams' ops the core returns, in order, and nothing of its own
([Note: streams as effects], fz3/core/streams.py; the ops' safety is the stream machine's:
property_tests/test_stream_machine.py).

A CPU device whose streams and events record what is done to them stands in for an
accelerator's; two thread ranks train a small model for a few steps (accumulation, so reduces
complete at WaitReduce and at the next reduce alike). Each rank's record must be the ops
fz3/core/streams.py returned to its interpreter, mapped onto the device: Record -> an event
recorded on that stream, WaitEvent -> that stream waiting that event, Launch -> the collective
issued inside that stream."""
from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
from torch import nn

import fz3
import fz3.api
from fz3 import launch
from fz3.core import streams
from fz3.shell.device import CpuDevice

pytestmark = pytest.mark.timeout(300)


class Stream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_event(self, event) -> None:
        self.log.append(("wait", self.name, event.id))

    def wait_stream(self, other) -> None:
        self.log.append(("wait_stream", self.name, other.name))


class Event:
    def __init__(self, id: int) -> None:
        self.id = id


class RecordingDevice(CpuDevice):
    """A CPU device with named streams and events that log what is done to them."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list = []
        self.ids = itertools.count()
        self.names = iter(("gather", "reduce"))  # the interpreter makes the gather stream first
        self._current = self.compute = Stream("compute", self.log)

    def new_stream(self):
        return Stream(next(self.names), self.log)

    @contextlib.contextmanager
    def stream(self, stream):
        self.log.append(("enter", stream.name))
        with super().stream(stream):
            yield stream

    def wait_stream(self, waiter, waitee) -> None:
        self.log.append(("wait_stream", waiter.name, waitee.name))

    def record_event(self, stream=None):
        event = Event(next(self.ids))
        self.log.append(("record", (stream or self._current).name, event.id))
        return event


def _expected(ops: list) -> list:
    """The device calls the core's ops make, events numbered as the device numbers them."""
    out, number = [], {}
    for op in ops:
        match op:
            case streams.Record(stream=s, event=e):
                number[e] = len(number)
                out.append(("record", s, number[e]))
            case streams.WaitEvent(stream=s, event=e):
                out.append(("wait", s, number[e]))
            case streams.Launch(stream=s):
                out.append(("enter", s))
    return out


def test_the_interpreter_runs_the_cores_stream_ops(monkeypatch):
    devices, ops, depth = {}, {}, {}
    for name in ("gather", "gathered", "refresh", "reduce", "complete", "complete_all"):
        real = getattr(streams, name)

        def wrapped(*args, _real=real, **kwargs):  # the outermost call's ops (reduce calls complete)
            rank = threading_rank()
            depth[rank] = depth.get(rank, 0) + 1
            try:
                st, got = _real(*args, **kwargs)
            finally:
                depth[rank] -= 1
            if not depth[rank]:
                ops.setdefault(rank, []).extend(got)
            return st, got
        monkeypatch.setattr(streams, name, wrapped)

    def pick():
        dev = devices[threading_rank()] = RecordingDevice()
        return dev
    monkeypatch.setattr(fz3.api, "pick_device", pick)

    def train(rank: int, world: int):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
        engine = fz3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                fz3.Config(param_persistence_threshold=16, reduce_bucket_size=100,
                                           gradient_accumulation_steps=2))
        g = torch.Generator().manual_seed(rank)
        for _ in range(6):
            engine.backward(engine(torch.randn(4, 8, generator=g)).square().mean())
            engine.step()

    launch.run_threads(train, 2)
    for rank, dev in devices.items():
        log = [entry for entry in dev.log if entry[0] != "enter" or entry[1] != "compute"]
        assert not [e for e in log if e[0] == "wait_stream"], "the interpreter ordered streams itself"
        assert log == _expected(ops[rank])
        kinds = {(e[0], e[1]) for e in log}
        assert {("enter", "gather"), ("enter", "reduce"), ("wait", "compute"), ("wait", "gather"),
                ("wait", "reduce"), ("record", "gather"), ("record", "reduce")} <= kinds, kinds


def threading_rank() -> int:
    from fz3.interpreters import threads
    return threads.current().rank
