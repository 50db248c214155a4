"""Offload settings: DeepSpeed's `zero_optimization.offload_optimizer`, `offload_param` and the
`aio` section, with DeepSpeed 0.19.8's names, defaults and meaning (runtime/zero/offload_config.py,
runtime/swap_tensor/aio_config.py), checked on construction.

    OffloadOptimizer(device="nvme", nvme_path="/local/nvme")   fp32 masters and optimizer state
                                                               on disk, stepped a sub-group at a time
    OffloadParam(device="cpu")                                 compute shards in host memory
    Aio(block_size=1 << 20, intra_op_parallelism=1)            how the disk is read and written

A Config takes each as a value of its own or as the dict DeepSpeed's JSON holds. What "cpu" and
"nvme" do in fz3, and where DeepSpeed itself ignores a key: fz3/core/offload.py and
docs/deepspeed.md ("Offload"). DeepSpeed's own behaviour on this machine, every stage and device:
tests/data/deepspeed_offload_0.19.8.json (bench/deepspeed_records/deepspeed_offload.py).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Mapping, Optional

DEVICES = ("none", "cpu", "nvme")  # DeepSpeed's OffloadDeviceEnum


@dataclass(frozen=True)
class OffloadOptimizer:
    """zero_optimization.offload_optimizer. `ratio`: the share of the optimizer's sub-groups
    offloaded (the last ones, as DeepSpeed picks them; stage 3 only). `pipeline_read` /
    `pipeline_write`: read sub-group i+1 while i steps / write i back while i+1 steps, each at the
    cost of one more sub-group in memory (DeepSpeed's default: neither). `pin_memory`: on an
    accelerator's ranks, the host buffers the optimizer steps in are pinned (fz3/data/store.py
    `pin`); CPU ranks have nothing to pin."""

    device: str = "none"
    nvme_path: Optional[str] = None
    pin_memory: bool = True
    buffer_count: int = 4
    fast_init: bool = False
    ratio: float = 1.0
    pipeline_read: bool = False
    pipeline_write: bool = False

    def __post_init__(self) -> None:
        _check_device("offload_optimizer", self.device, self.nvme_path)
        for name in ("pin_memory", "fast_init", "pipeline_read", "pipeline_write"):
            _check_bool(f"offload_optimizer.{name}", getattr(self, name))
        _set_count(self, "offload_optimizer", "buffer_count")
        ratio = self.ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not (math.isfinite(ratio)
                                                                                   and 0 <= ratio <= 1):
            raise ValueError(f"zero_optimization.offload_optimizer.ratio = {ratio!r}: the share of the optimizer "
                             "state offloaded, a number from 0 to 1 (DeepSpeed 0.19.8: 'Input should be less than "
                             "or equal to 1'; 1, the default, offloads all of it)")

    @property
    def on(self) -> bool:
        return self.device != "none"


@dataclass(frozen=True)
class OffloadParam:
    """zero_optimization.offload_param (stage 3 only, as in DeepSpeed)."""

    device: str = "none"
    nvme_path: Optional[str] = None
    pin_memory: bool = True
    buffer_count: int = 5
    buffer_size: int = 100_000_000
    max_in_cpu: int = 1_000_000_000

    def __post_init__(self) -> None:
        _check_device("offload_param", self.device, self.nvme_path)
        _check_bool("offload_param.pin_memory", self.pin_memory)
        for name in ("buffer_count", "buffer_size", "max_in_cpu"):
            _set_count(self, "offload_param", name)

    @property
    def on(self) -> bool:
        return self.device != "none"


@dataclass(frozen=True)
class Aio:
    """The `aio` section: how the NVMe tier reads and writes. fz3 reads and writes each file in
    `block_size`-byte calls from `intra_op_parallelism` threads (fz3/data/swap.py);
    `queue_depth`, `single_submit` and `overlap_events` are libaio's submission settings, which
    fz3's threads have no use for (accepted, reported); `use_gds` (GPUDirect Storage) is
    refused."""

    block_size: int = 1 << 20
    queue_depth: int = 8
    intra_op_parallelism: int = 1
    single_submit: bool = False
    overlap_events: bool = True
    use_gds: bool = False

    def __post_init__(self) -> None:
        for name in ("block_size", "queue_depth", "intra_op_parallelism"):
            _set_count(self, "aio", name, low=1)
        for name in ("single_submit", "overlap_events", "use_gds"):
            _check_bool(f"aio.{name}", getattr(self, name))
        if self.use_gds:
            raise ValueError("aio.use_gds = true: fz3 reads and writes the NVMe tier through host memory, without "
                             "GPUDirect Storage (DeepSpeed 0.19.8 allows it on CUDA only); set it false")


def section(cls, name: str, value: object):
    """`value` as `cls`: an instance as it is, None as the default, a DeepSpeed JSON dict by its
    keys (an unknown one is an error naming it)."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a dict of DeepSpeed's keys or an fz3.config.offload.{cls.__name__}, "
                        f"got {value!r}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - known - set(IGNORED.get(cls.__name__, {})))
    if unknown:
        raise ValueError(f"{name}: unknown key(s) {unknown} (misspelt?); DeepSpeed 0.19.8's are "
                         f"{sorted(known | set(IGNORED.get(cls.__name__, {})))}")
    return cls(**{k: v for k, v in value.items() if k in known})


# DeepSpeed keys of these sections that change nothing fz3 does (on these ranks, with its threads):
# key -> why. Config.from_deepspeed reports them once, as it reports every unused key; the ones
# that are fields are kept, so the Config still says what the JSON said.
IGNORED = {
    "OffloadOptimizer": {
        "super_offload": "Grace Hopper superchip scheduling of DeepSpeed's CPU Adam: fz3 steps the user's optimizer",
        "cpuadam_cores_perc": "the share of cores DeepSpeed's CPU Adam takes with super_offload",
        "buffer_count": "DeepSpeed's pool of swap buffers: fz3 reads each sub-group into its own tensors",
        "fast_init": "how DeepSpeed first writes the optimizer's swap files: fz3 writes them at the first step",
    },
    "OffloadParam": {
        "pin_memory": "pinned host buffers for an accelerator's params: fz3 keeps them on the device",
        "buffer_count": "DeepSpeed's pool of param swap buffers", "buffer_size": "DeepSpeed's pool of param swap buffers",
        "max_in_cpu": "params kept in host memory under NVMe param offload, which fz3 does not build yet",
    },
    "Aio": {
        "queue_depth": "libaio's submission queue: fz3's threads have none",
        "single_submit": "libaio's submission mode", "overlap_events": "libaio's event overlap",
    },
}


def _check_device(name: str, device: object, nvme_path: object) -> None:
    if device not in DEVICES:
        raise ValueError(f"zero_optimization.{name}.device = {device!r}: DeepSpeed's offload devices are 'none', "
                         "'cpu' and 'nvme' (DeepSpeed 0.19.8: \"Input should be 'none', 'cpu' or 'nvme'\"); the "
                         "accelerator itself is 'none'")
    if nvme_path is not None and not isinstance(nvme_path, str):
        raise TypeError(f"zero_optimization.{name}.nvme_path must be a path (a string), got {nvme_path!r}")
    if device == "nvme" and not nvme_path:
        raise ValueError(f"zero_optimization.{name}.device = 'nvme' without nvme_path: name the folder on the "
                         f"NVMe drive the files go to ({name}.nvme_path)")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be true or false, got {value!r}")


def _set_count(obj: object, where: str, name: str, low: int = 0) -> None:
    """obj.name checked to be a whole number >= low, and kept as an int (JSON's 1e8 too)."""
    value = getattr(obj, name)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{where}.{name} must be a whole number >= {low}, got {getattr(obj, name)!r}")
    object.__setattr__(obj, name, value)
