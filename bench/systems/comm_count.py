"""Count torch.distributed collectives (calls and buffer bytes) inside one rank process.

    counter = install()      # wrap the collectives of torch.distributed, before any system
                             # captures them (DeepSpeed's TorchBackend keeps references)
    counter.reset(); ...; counter.snapshot()   # {op: {"calls": n, "bytes": b}}

Bytes are the size of the collective's full buffer, the same definition as fz3's
engine.stats(): all-gather -> output bytes (W x shard), reduce-scatter -> input bytes
(W x shard), all-reduce / broadcast / reduce -> the tensor's bytes. A rank sends and receives
(W-1)/W of that with a ring. Point-to-point sends (fz3's gloo collectives, p2p.py) count the
bytes sent, over gloo or through fz3's shared-memory rings (SharedMemoryTransport.isend: a
large message never reaches torch.distributed). Nested calls (e.g. _all_gather_base -> all_gather_into_tensor)
count once, at the outermost.
"""
from __future__ import annotations

import functools
import inspect
import threading
from collections import defaultdict

import torch
import torch.distributed as dist

# op name -> (argument holding the buffer whose bytes count, kind)
OPS = {
    "all_gather_into_tensor": "output_tensor",
    "all_gather_single": "output_tensor",  # torch 2.13 name (FSDP2 calls it)
    "_all_gather_base": "output_tensor",
    "all_gather": "tensor_list",
    "all_gather_coalesced": "output_tensor_lists",
    "reduce_scatter_tensor": "input",
    "reduce_scatter_single": "input",  # torch 2.13 name (FSDP2 calls it)
    "_reduce_scatter_base": "input",
    "reduce_scatter": "input_list",
    "all_reduce": "tensor",
    "all_reduce_coalesced": "tensors",
    "broadcast": "tensor",
    "reduce": "tensor",
    "all_to_all_single": "input",
    "isend": "tensor",
    "send": "tensor",
}
KIND = {"all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",
        "reduce_scatter_single": "reduce_scatter", "_all_gather_base": "all_gather",
        "all_gather": "all_gather", "all_gather_coalesced": "all_gather",
        "reduce_scatter_tensor": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
        "reduce_scatter": "reduce_scatter", "all_reduce": "all_reduce",
        "all_reduce_coalesced": "all_reduce", "broadcast": "broadcast", "reduce": "reduce",
        "all_to_all_single": "all_to_all", "isend": "send", "send": "send"}


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        t = x._local_tensor if hasattr(x, "_local_tensor") else x
        return t.numel() * t.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


class Counter:
    def __init__(self) -> None:
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)
        self._depth = threading.local()

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {k: {"calls": self.calls[k], "bytes": self.bytes[k]} for k in sorted(self.calls)}

    def wrap(self, name: str, fn, arg: str | None = None):
        """fn counted as op `name`; `arg`: the argument holding the buffer, when not OPS's."""
        sig = inspect.signature(fn)
        arg, kind = arg or OPS[name], KIND[name]

        @functools.wraps(fn)
        def counted(*args, **kwargs):
            depth = getattr(self._depth, "n", 0)
            if depth == 0:
                try:
                    nbytes = _nbytes(sig.bind_partial(*args, **kwargs).arguments.get(arg))
                except TypeError:
                    nbytes = 0
                self.calls[kind] += 1
                self.bytes[kind] += nbytes
            self._depth.n = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.n = depth
        counted.__fz3_bench_counted__ = True
        return counted


def install(rings: bool = False) -> Counter:
    """Wrap torch.distributed's collectives; `rings`: fz3's shared-memory sends too (fz3's
    processes only: the peers' stay without fz3 imported)."""
    counter = Counter()
    c10d = dist.distributed_c10d
    for name in OPS:
        for mod in (dist, c10d):
            fn = getattr(mod, name, None)
            if fn is None or getattr(fn, "__fz3_bench_counted__", False):
                continue
            setattr(mod, name, counter.wrap(name, fn))
    if not rings:
        return counter
    from fz3.interpreters.shared_memory import SharedMemoryTransport
    if not getattr(SharedMemoryTransport.isend, "__fz3_bench_counted__", False):
        SharedMemoryTransport.isend = counter.wrap("isend", SharedMemoryTransport.isend, arg="t")
    return counter
