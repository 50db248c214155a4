"""The shell's device: streams, events, synchronize, memory stats and the process-group backend.

Two implementations of one small interface, chosen by `pick_device` (fz3/shell/pick.py):

    FZ3_DEVICE=cpu  ------------------------------------------------> CpuDevice               gloo
    FZ3_DEVICE=npu  -- torch_npu imports, accelerator is npu ------> AcceleratorDevice('npu')  hccl
    FZ3_DEVICE=cuda -- accelerator is cuda -------------------------> AcceleratorDevice('cuda') nccl
    unset           -- the npu test, else the cuda test, else ------> CpuDevice               gloo
    (a forced device that is absent, or LOCAL_RANK >= device count, is an error)

`AcceleratorDevice` is written only against the generic `torch.accelerator` / `torch.Stream` /
`torch.Event` API, so CUDA and Ascend NPU share one code path. `CpuDevice` is synchronous: on
CPU/gloo `torch.accelerator` streams and events raise, and the only concurrency is a
collective's async `Work`, so its streams and events are inert `NullStream` / `NullEvent`.

[Note: torch_npu is imported lazily] `import torch_npu` registers the 'npu' device with torch
(and fails without Huawei's CANN toolkit), so it happens only inside `TorchProbe.has_module`
(pick.py), when `pick_device` asks for it, never when this module is imported. torch may
also autoload an installed torch_npu during `import torch`; fz3 does not set
TORCH_DEVICE_BACKEND_AUTOLOAD=0, but a user whose stray torch_npu install breaks `import torch`
can (docs/environment.md).
"""
from __future__ import annotations

import contextlib
import resource
from collections.abc import Iterator
from types import ModuleType
from typing import Protocol, Union, runtime_checkable

import torch

KINDS = ("cpu", "cuda", "npu")
"""Values FZ3_DEVICE accepts (unset or empty means: choose automatically)."""

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
"""torch.distributed backend for each device type fz3 knows."""


@runtime_checkable
class Device(Protocol):
    """The shell's whole view of the hardware: fourteen members, nothing else is device-specific.

    The shell issues gathers and reduces on side streams and orders them with `wait_stream` and
    events, exactly as DeepSpeed's `get_accelerator()` calls do; on CPU those calls are no-ops.
    """

    type: str
    """Device type: 'cpu', 'cuda' or 'npu'."""
    backend: str
    """torch.distributed backend for this device: 'gloo', 'nccl' or 'hccl'."""
    torch_device: torch.device
    """This rank's device, e.g. cuda:{local_rank}; where tensors and buffers are allocated."""
    is_async: bool
    """Whether kernels run asynchronously on streams (False on CPU: only async Work overlaps)."""

    def set_device(self) -> None:
        """Make `torch_device` this process's current device (before init_process_group)."""
    def current_stream(self) -> Stream:
        """The stream work is issued on right now (the compute stream by default)."""
    def new_stream(self) -> Stream:
        """A new side stream, e.g. for all-gathers or reduce-scatters."""
    def stream(self, stream: Stream) -> contextlib.AbstractContextManager[Stream]:
        """Context manager making `stream` current inside the block, restoring the old one after."""
    def wait_stream(self, waiter: Stream, waitee: Stream) -> None:
        """Make later work on `waiter` wait for everything already issued on `waitee`."""
    def record_event(self, stream: Stream | None = None) -> Event:
        """A new event recorded on `stream` (current stream if None); `.wait`/`.synchronize` it."""
    def synchronize(self) -> None:
        """Block the host until all work on this device has finished."""
    def memory_allocated(self) -> int:
        """Bytes held by live tensors now (CPU: resident set size, see CpuDevice)."""
    def max_memory_allocated(self) -> int:
        """Peak of `memory_allocated` since start or the last `reset_peak_memory_stats`."""
    def reset_peak_memory_stats(self) -> None:
        """Start a new peak window for `max_memory_allocated`."""


class NullEvent:
    """An event on CPU: always complete, since CPU work is synchronous."""

    def record(self, stream: Stream | None = None, /) -> None:
        """No-op: all prior CPU work has already finished."""

    def wait(self, stream: Stream | None = None, /) -> None:
        """No-op: nothing to wait for."""

    def synchronize(self) -> None:
        """No-op."""

    def query(self) -> bool:
        """Always True: the event is complete."""
        return True


class NullStream:
    """A stream on CPU: an inert handle, so the shell runs the same code on every device."""

    def wait_stream(self, stream: Stream, /) -> None:
        """No-op: CPU work is ordered by program order."""

    def wait_event(self, event: Event, /) -> None:
        """No-op, as `wait_stream`."""

    def record_event(self, event: Event | None = None, /) -> Event:
        """`event` (or a new `NullEvent`), already complete."""
        return NullEvent() if event is None else event

    def synchronize(self) -> None:
        """No-op."""

    def query(self) -> bool:
        """Always True: nothing is pending."""
        return True


Stream = Union[torch.Stream, NullStream]
"""A device stream: `torch.Stream` on accelerators, `NullStream` on CPU."""
Event = Union[torch.Event, NullEvent]
"""A device event: `torch.Event` on accelerators, `NullEvent` on CPU."""


class CpuDevice:
    """Synchronous CPU device for gloo. Streams and events are `NullStream` / `NullEvent`.

    [Note: CPU memory stats] CPU has no caching allocator and no allocator statistics, so the
    memory members report the process's resident set size: VmRSS and its peak VmHWM from
    /proc/self/status, the peak reset by writing 5 to /proc/self/clear_refs (Linux).
    Where /proc is missing the peak falls back to getrusage's ru_maxrss, which cannot be reset.
    RSS counts everything in the process, and glibc's allocator keeps freed memory, hiding what
    sharding saves: measure with MALLOC_MMAP_THRESHOLD_=131072 (docs/environment.md).
    """

    type = "cpu"
    backend = "gloo"
    torch_device = torch.device("cpu")
    is_async = False

    def __init__(self) -> None:
        """A CPU device; it only remembers which `NullStream` is current."""
        self._current: Stream = NullStream()

    def __repr__(self) -> str:
        return "CpuDevice(backend='gloo')"

    def set_device(self) -> None:
        """Nothing to select on CPU."""

    def current_stream(self) -> Stream:
        """The current `NullStream` (the one set by an enclosing `stream` block, if any)."""
        return self._current

    def new_stream(self) -> Stream:
        """A fresh `NullStream`."""
        return NullStream()

    @contextlib.contextmanager
    def stream(self, stream: Stream) -> Iterator[Stream]:
        """Make `stream` current inside the block (so code reading it behaves as on a GPU)."""
        previous, self._current = self._current, stream
        try:
            yield stream
        finally:
            self._current = previous

    def wait_stream(self, waiter: Stream, waitee: Stream) -> None:
        """No-op: CPU work is already ordered."""

    def record_event(self, stream: Stream | None = None) -> Event:
        """A complete `NullEvent`."""
        return NullEvent()

    def synchronize(self) -> None:
        """No-op: CPU work is synchronous (wait on async collectives via their Work)."""

    def memory_allocated(self) -> int:
        """Current resident set size in bytes (0 without /proc); see [Note: CPU memory stats]."""
        return _proc_status_bytes("VmRSS") or 0

    def max_memory_allocated(self) -> int:
        """Peak resident set size in bytes since start or the last reset."""
        peak = _proc_status_bytes("VmHWM")
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 if peak is None else peak

    def reset_peak_memory_stats(self) -> None:
        """Reset the kernel's peak RSS to the current RSS where Linux allows it; else no-op."""
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass


class MetaDevice(CpuDevice):
    """Shapes without memory, for fz3.plan: tensors are fake cpu tensors over meta storage
    (fz3/observe/fake.py; the plan runs inside its FakeTensorMode, so every tensor made on
    `torch_device` is fake) and no work runs. cpu, so they meet the tensors a forward makes
    without a device. `backend` is the one being planned for (it picks the carriers counted)."""

    type = "meta"
    torch_device = torch.device("cpu")

    def __init__(self, backend: str = "gloo") -> None:
        super().__init__()
        self.backend = backend

    def __repr__(self) -> str:
        return f"MetaDevice(backend={self.backend!r})"

    def memory_allocated(self) -> int:
        """Meta tensors hold no memory."""
        return 0

    def max_memory_allocated(self) -> int:
        return 0

    def reset_peak_memory_stats(self) -> None:
        """Nothing to reset."""


def _proc_status_bytes(field: str) -> int | None:
    """A kB field of /proc/self/status (Linux) in bytes, or None where it cannot be read."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class AcceleratorDevice:
    """CUDA or Ascend NPU through the generic `torch.accelerator` / `torch.Stream` / `torch.Event`.

    `torch_module` is injectable so tests can check the wiring with a fake accelerator.
    """

    is_async = True

    def __init__(self, kind: str, local_rank: int = 0, *, torch_module: ModuleType = torch) -> None:
        """Bind to device `kind:local_rank`; touches no device until a method is called."""
        self.type = kind
        self.local_rank = local_rank
        self.torch_device = torch_module.device(kind, local_rank)
        # fz3's table first; torch's registered default covers other accelerators (xpu: xccl).
        self.backend = BACKENDS.get(kind) or torch_module.distributed.get_default_backend_for_device(kind)
        self._torch = torch_module
        self._acc = torch_module.accelerator
        # torch 2.13's torch.accelerator has memory stats; older torch: torch.cuda / torch.npu.
        self._mem = self._acc if hasattr(self._acc, "memory_allocated") else getattr(torch_module, kind)

    def __repr__(self) -> str:
        return f"AcceleratorDevice({self.type!r}, {self.local_rank}, backend={self.backend!r})"

    def set_device(self) -> None:
        """Make this rank's device current (`torch.accelerator.set_device_index`)."""
        self._acc.set_device_index(self.local_rank)

    def current_stream(self) -> Stream:
        """`torch.accelerator.current_stream` for this device."""
        return self._acc.current_stream(self.torch_device)

    def new_stream(self) -> Stream:
        """A new `torch.Stream` on this device."""
        return self._torch.Stream(device=self.torch_device)

    @contextlib.contextmanager
    def stream(self, stream: Stream) -> Iterator[Stream]:
        """`torch.accelerator.set_stream(stream)` for the block; restores the previous stream."""
        previous = self._acc.current_stream(self.torch_device)
        self._acc.set_stream(stream)
        try:
            yield stream
        finally:
            self._acc.set_stream(previous)

    def wait_stream(self, waiter: Stream, waitee: Stream) -> None:
        """`waiter.wait_stream(waitee)`: device-side ordering, the host does not block."""
        waiter.wait_stream(waitee)

    def record_event(self, stream: Stream | None = None) -> Event:
        """A new `torch.Event` recorded on `stream` (the current stream if None)."""
        event = self._torch.Event(device=self.torch_device)
        event.record(self.current_stream() if stream is None else stream)
        return event

    def synchronize(self) -> None:
        """`torch.accelerator.synchronize` on this device."""
        self._acc.synchronize(self.torch_device)

    def memory_allocated(self) -> int:
        """Bytes held by live tensors on this device (caching-allocator statistics)."""
        return int(self._mem.memory_allocated(self.local_rank))

    def max_memory_allocated(self) -> int:
        """Peak bytes held by live tensors since start or the last reset."""
        return int(self._mem.max_memory_allocated(self.local_rank))

    def reset_peak_memory_stats(self) -> None:
        """Start a new peak window on this device."""
        self._mem.reset_peak_memory_stats(self.local_rank)
