"""Choosing this rank's device (FZ3_DEVICE if set, else NPU, then CUDA, then CPU) and its backend.

The machine is asked through a small `Probe`, so tests simulate CUDA or an Ascend NPU with a
fake (tests/test_device.py); `TorchProbe` is the real one, importing torch_npu only when asked.

The process-group backend follows the device, never the other way round:

    FZ3_DEVICE, LOCAL_RANK, what is present --pick_device--------> device
    device, backend=None                     --backend_for--------> device.backend (gloo/nccl/hccl)
    device, backend='gloo' (explicit)        --backend_for--------> 'gloo' if it fits, else ValueError
    device, the process group (initialize)   --check_group_backend-> fits, else RuntimeError

[Note: the backend must fit the device] cpu needs gloo, cuda nccl, npu hccl (device.BACKENDS).
The shell picks its collectives from `device.backend` (gloo carriers on gloo, native ones
otherwise, fz3/interpreters/dist.py), so a group on another backend would fail at the first
collective (nccl with CPU tensors) or run through a path never meant for it (gloo with GPU
tensors); both are refused up front, naming the group's backend and the device.
A group with several backends (torch's 'cpu:gloo,cuda:nccl') fits when its entry for this
device type is the right one.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import warnings
from collections.abc import Mapping
from types import ModuleType
from typing import Protocol

import torch
import torch.distributed as dist

from fz3.shell.device import BACKENDS, KINDS, AcceleratorDevice, CpuDevice, Device


class Probe(Protocol):
    """What `pick_device` asks about the machine; tests pass a fake to simulate CUDA or NPU."""

    def has_module(self, name: str) -> bool:
        """Whether module `name` imports (importing it may register a device type)."""
    def accelerator_type(self) -> str | None:
        """torch.accelerator's device type ('cuda', 'npu', ...), None when there is none."""
    def device_count(self) -> int:
        """How many devices of that type this process sees."""


class TorchProbe:
    """The real `Probe`, on `torch.accelerator` and importlib."""

    def __init__(self, torch_module: ModuleType = torch) -> None:
        self._acc = torch_module.accelerator

    def has_module(self, name: str) -> bool:
        """Import `name` if it is installed; warn (not raise) when it is installed but broken."""
        if importlib.util.find_spec(name) is None:
            return False
        try:
            importlib.import_module(name)
        except Exception as e:  # torch_npu without CANN fails with assorted errors
            warnings.warn(f"fz3: {name} is installed but failed to import: {e!r}", stacklevel=2)
            return False
        return True

    def accelerator_type(self) -> str | None:
        """`torch.accelerator.current_accelerator().type`, or None without an available one."""
        if not self._acc.is_available():
            return None
        current = self._acc.current_accelerator()
        return None if current is None else current.type

    def device_count(self) -> int:
        """`torch.accelerator.device_count()`."""
        return int(self._acc.device_count())


def pick_device(local_rank: int | None = None, *, env: Mapping[str, str] = os.environ,
                torch_module: ModuleType = torch, probe: Probe | None = None) -> Device:
    """Choose this rank's device: FZ3_DEVICE if set, else NPU, then CUDA, then CPU.

    `local_rank` defaults to env LOCAL_RANK (set by torchrun), else 0. A forced device that is
    not there is an error, not a silent fallback, so a run never lands on the wrong hardware;
    so is a local rank past the device count, even in auto mode, since ranks that fell back to
    gloo could never join the others' nccl/hccl collectives.
    Mirrors DeepSpeed's `get_accelerator()` (DS_ACCELERATOR, then probing); unlike it, there is
    one generic accelerator class rather than one per vendor.
    """
    rank = int(env.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
    wanted = env.get("FZ3_DEVICE", "").strip()
    if wanted.lower() not in ("", *KINDS):
        raise ValueError(f"FZ3_DEVICE={wanted!r} is not one of {', '.join(KINDS)} (or unset: auto)")
    wanted = wanted.lower()
    if wanted == "cpu":
        return CpuDevice()
    probe = TorchProbe(torch_module) if probe is None else probe
    for kind in ("npu", "cuda"):
        if wanted not in ("", kind):
            continue
        reason = _absent(kind, probe)
        if reason is None:
            count = probe.device_count()
            if rank < count:
                return AcceleratorDevice(kind, rank, torch_module=torch_module)
            reason = f"local rank {rank} needs {kind}:{rank} but {count} {kind} device(s) are visible"
            if count > 0:
                raise RuntimeError(reason)
        if wanted:
            raise RuntimeError(f"FZ3_DEVICE={wanted!r} but {reason}")
    return CpuDevice()


def _absent(kind: str, probe: Probe) -> str | None:
    """Why device type `kind` is not on this machine, or None when it is."""
    if kind == "npu" and not probe.has_module("torch_npu"):
        return "torch_npu is not importable (it needs Huawei's CANN toolkit)"
    found = probe.accelerator_type()
    if found != kind:
        return f"torch.accelerator reports {found or 'no accelerator'}, not {kind}"
    return None


def backend_in(spec: str, device_type: str) -> str | None:
    """The backend a torch backend spec uses for `device_type`, None when it names none.

    `spec` is what `init_process_group` takes or `dist.get_backend_config` returns: a bare name
    ('gloo', which then stands for every device type) or 'cpu:gloo,cuda:nccl' pairs.
    """
    spec = spec.strip().lower()
    if ":" not in spec:
        return spec or None
    pairs = (pair.partition(":") for pair in spec.split(","))
    return {kind.strip(): backend.strip() for kind, _, backend in pairs}.get(device_type)


def backend_for(device: Device, backend: str | None = None) -> str:
    """The backend to init the process group with on `device`: its own when `backend` is None,
    else `backend` itself if it fits; see [Note: the backend must fit the device]."""
    if backend is None:
        return device.backend
    if backend_in(backend, device.type) != device.backend:
        raise ValueError(f"backend={backend!r} does not fit this rank's device {device.torch_device}, "
                         f"which needs {device.backend!r} ({_PAIRS}): pass backend=None (the "
                         f"device's) or {device.backend!r}, or choose another device with FZ3_DEVICE")
    return backend


def check_group_backend(device: Device, group: dist.ProcessGroup | None = None) -> None:
    """Raise unless `group` (None: the default group) uses `device.backend` for this device type;
    see [Note: the backend must fit the device]. Called by fz3.initialize, before any collective."""
    config = dist.get_backend_config(group)
    used = backend_in(config, device.type)
    if used != device.backend:
        raise RuntimeError(
            f"fz3.initialize: the process group's backend is {config!r} ({used or 'nothing'} for "
            f"{device.type}), but this rank's device is {device.torch_device}, which needs "
            f"{device.backend!r} ({_PAIRS}): init the group with backend={device.backend!r}, or "
            "with fz3.launch.init_from_env() / fz3.launch.run(), which pick it from the device "
            "(FZ3_DEVICE chooses the device)")


_PAIRS = "fz3 pairs " + ", ".join(f"{kind} with {backend}" for kind, backend in BACKENDS.items())
