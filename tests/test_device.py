"""fz3.shell.device: automatic device choice (with a fake probe), the CPU device, the accelerator wiring."""
import sys
from types import SimpleNamespace
from typing import NamedTuple

import pytest
import torch

from fz3.shell.device import AcceleratorDevice, CpuDevice, Device, NullEvent, NullStream
from fz3.shell.pick import TorchProbe, pick_device


class FakeProbe:
    """A machine as `pick_device` sees it; `calls` records what was asked."""

    def __init__(self, modules=(), accel=None, count=0):
        self.modules, self.accel, self.count, self.calls = set(modules), accel, count, []

    def has_module(self, name):
        self.calls.append(("has_module", name))
        return name in self.modules

    def accelerator_type(self):
        self.calls.append(("accelerator_type",))
        return self.accel

    def device_count(self):
        self.calls.append(("device_count",))
        return self.count


NPU = dict(modules={"torch_npu"}, accel="npu", count=8)
CUDA = dict(accel="cuda", count=2)


@pytest.mark.parametrize("machine, env, want", [
    (NPU, {}, ("npu", "hccl", "npu:0")),
    (CUDA, {}, ("cuda", "nccl", "cuda:0")),
    ({}, {}, ("cpu", "gloo", "cpu")),
    (dict(accel="mps", count=1), {}, ("cpu", "gloo", "cpu")),           # not an fz3 accelerator
    (dict(modules={"torch_npu"}, accel="cuda", count=2), {}, ("cuda", "nccl", "cuda:0")),
    (dict(accel="cuda", count=0), {}, ("cpu", "gloo", "cpu")),
    (CUDA, {"LOCAL_RANK": "1"}, ("cuda", "nccl", "cuda:1")),
    (NPU, {"FZ3_DEVICE": "npu", "LOCAL_RANK": "7"}, ("npu", "hccl", "npu:7")),
    (CUDA, {"FZ3_DEVICE": " CUDA "}, ("cuda", "nccl", "cuda:0")),
    (NPU, {"FZ3_DEVICE": ""}, ("npu", "hccl", "npu:0")),                # empty means auto
])
def test_pick_device_chooses(machine, env, want):
    dev = pick_device(env=env, probe=FakeProbe(**machine), torch_module=fake_torch())
    assert (dev.type, dev.backend, str(dev.torch_device)) == want
    assert isinstance(dev, Device)


@pytest.mark.parametrize("machine, env, error, words", [
    ({}, {"FZ3_DEVICE": "npu"}, RuntimeError, ["'npu'", "torch_npu"]),
    (dict(accel="npu", count=8), {"FZ3_DEVICE": "npu"}, RuntimeError, ["torch_npu"]),
    (dict(modules={"torch_npu"}), {"FZ3_DEVICE": "npu"}, RuntimeError, ["no accelerator"]),
    ({}, {"FZ3_DEVICE": "cuda"}, RuntimeError, ["'cuda'", "no accelerator"]),
    (NPU, {"FZ3_DEVICE": "cuda"}, RuntimeError, ["reports npu"]),
    (dict(accel="cuda", count=0), {"FZ3_DEVICE": "cuda"}, RuntimeError, ["0 cuda device"]),
    (CUDA, {"LOCAL_RANK": "2"}, RuntimeError, ["local rank 2", "2 cuda device"]),  # even in auto
    ({}, {"FZ3_DEVICE": "bogus"}, ValueError, ["'bogus'", "cpu, cuda, npu"]),
    ({}, {"FZ3_DEVICE": "gpu"}, ValueError, ["'gpu'", "cpu, cuda, npu"]),
])
def test_pick_device_refuses(machine, env, error, words):
    with pytest.raises(error) as info:
        pick_device(env=env, probe=FakeProbe(**machine), torch_module=fake_torch())
    assert all(w in str(info.value) for w in words), str(info.value)


def test_forced_cpu_probes_nothing_and_explicit_rank_beats_env():
    probe = FakeProbe(**NPU)
    assert isinstance(pick_device(env={"FZ3_DEVICE": "cpu"}, probe=probe), CpuDevice)
    assert probe.calls == []  # torch_npu is not even looked for
    dev = pick_device(3, env={"LOCAL_RANK": "1"}, probe=FakeProbe(**NPU), torch_module=fake_torch())
    assert str(dev.torch_device) == "npu:3"


def test_forced_cuda_never_imports_torch_npu():
    probe = FakeProbe(**CUDA)
    pick_device(env={"FZ3_DEVICE": "cuda"}, probe=probe, torch_module=fake_torch())
    assert ("has_module", "torch_npu") not in probe.calls


def test_this_machine_gets_the_cpu_device(monkeypatch):
    monkeypatch.delenv("FZ3_DEVICE", raising=False)
    dev = pick_device()
    assert isinstance(dev, CpuDevice) and dev.backend == "gloo" and not dev.is_async
    assert "torch_npu" not in sys.modules


def test_cpu_device_members_all_work():
    dev = CpuDevice()
    assert isinstance(dev, Device) and dev.torch_device == torch.device("cpu")
    dev.set_device()
    main, side = dev.current_stream(), dev.new_stream()
    assert isinstance(side, NullStream) and side is not main
    with dev.stream(side) as s:
        assert s is side and dev.current_stream() is side
    assert dev.current_stream() is main
    dev.wait_stream(main, side)
    for ev in (dev.record_event(), dev.record_event(side), side.record_event()):
        assert isinstance(ev, NullEvent) and ev.query()
        ev.record(main), ev.wait(main), ev.synchronize()
    side.wait_event(ev), side.synchronize()
    dev.synchronize()
    assert dev.memory_allocated() > 0 and dev.max_memory_allocated() >= dev.memory_allocated()


def test_cpu_peak_memory_sees_a_new_allocation():
    dev = CpuDevice()
    dev.reset_peak_memory_stats()
    before, current = dev.max_memory_allocated(), dev.memory_allocated()
    big = torch.ones(16 * 2**20)  # 64 MiB, touched
    after = dev.max_memory_allocated()
    assert after >= before and after >= dev.memory_allocated() - 2**20
    if before <= current + 8 * 2**20:  # the reset took (Linux clear_refs), so the peak is fresh
        assert after - before >= 32 * 2**20
    del big


# --- AcceleratorDevice against a fake torch -------------------------------------------------


class FakeDevice(NamedTuple):
    type: str
    index: int

    def __str__(self):
        return f"{self.type}:{self.index}"


class FakeStream:
    def __init__(self, device=None):
        self.device, self.waited = device, []

    def wait_stream(self, other):
        self.waited.append(other)


class FakeEvent:
    def __init__(self, device=None):
        self.device, self.recorded_on = device, None

    def record(self, stream=None):
        self.recorded_on = stream


class FakeAccelerator:
    """torch.accelerator's surface; every call is logged."""

    def __init__(self, memory=True):
        self.log, self.current = [], FakeStream("default")
        if memory:
            self.memory_allocated = lambda i: self._log("memory_allocated", i) or 123
            self.max_memory_allocated = lambda i: self._log("max_memory_allocated", i) or 456
            self.reset_peak_memory_stats = lambda i: self._log("reset_peak", i)

    def _log(self, *call):
        self.log.append(call)

    def current_stream(self, device):
        return self.current

    def set_stream(self, stream):
        self._log("set_stream", stream)
        self.current = stream

    def set_device_index(self, i):
        self._log("set_device_index", i)

    def synchronize(self, device):
        self._log("synchronize", str(device))


def fake_torch(memory=True):
    return SimpleNamespace(
        accelerator=FakeAccelerator(memory), Stream=FakeStream, Event=FakeEvent, device=FakeDevice,
        npu=SimpleNamespace(memory_allocated=lambda i: 7, max_memory_allocated=lambda i: 9,
                            reset_peak_memory_stats=lambda i: None),
        distributed=SimpleNamespace(get_default_backend_for_device={"xpu": "xccl"}.__getitem__))


def test_accelerator_device_wiring_on_a_fake_npu():
    tm = fake_torch()
    dev = AcceleratorDevice("npu", 1, torch_module=tm)
    acc = tm.accelerator
    assert (dev.backend, str(dev.torch_device), dev.is_async) == ("hccl", "npu:1", True)
    assert isinstance(dev, Device)
    dev.set_device(), dev.synchronize()
    assert acc.log == [("set_device_index", 1), ("synchronize", "npu:1")]
    main, side = dev.current_stream(), dev.new_stream()
    assert side.device == dev.torch_device
    with dev.stream(side):
        assert dev.current_stream() is side
        ev = dev.record_event()
    assert dev.current_stream() is main and ev.recorded_on is side and ev.device == dev.torch_device
    assert dev.record_event(main).recorded_on is main
    dev.wait_stream(main, side)
    assert main.waited == [side]
    acc.log.clear()
    assert (dev.memory_allocated(), dev.max_memory_allocated()) == (123, 456)
    dev.reset_peak_memory_stats()
    assert acc.log == [("memory_allocated", 1), ("max_memory_allocated", 1), ("reset_peak", 1)]


def test_accelerator_device_fallbacks():
    old = AcceleratorDevice("npu", 0, torch_module=fake_torch(memory=False))  # no accelerator stats
    assert (old.memory_allocated(), old.max_memory_allocated()) == (7, 9)
    assert AcceleratorDevice("xpu", torch_module=fake_torch()).backend == "xccl"  # torch's default


def test_real_cuda_device_is_built_without_touching_a_gpu():
    dev = AcceleratorDevice("cuda", 1)
    assert (dev.backend, dev.torch_device) == ("nccl", torch.device("cuda", 1))


# --- TorchProbe ------------------------------------------------------------------------------


def test_torch_probe_on_this_machine(tmp_path, monkeypatch):
    probe = TorchProbe()
    assert probe.accelerator_type() is None and probe.device_count() == 0
    assert probe.has_module("json") and not probe.has_module("fz3_no_such_module")
    (tmp_path / "fz3_broken_backend.py").write_text("raise OSError('libascendcl.so not found')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(UserWarning, match="libascendcl"):
        assert not probe.has_module("fz3_broken_backend")
