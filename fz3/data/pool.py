"""Reusable flat buffers for the collectives: all-gather inputs and outputs, the params' full
values, reduce-scatter inputs and outputs, the point-to-point receive scratch.

Why: every step asks for the same buffer sizes (the trace repeats), and a fresh large tensor on
CPU is fresh memory from the OS, page-faulted on first write: about 0.8 ms per MiB here, more
than the copy itself (bench/RESULTS.md, "fz3 data-plane copies"). On an accelerator the caching
allocator already reuses memory, and the interpreter gives the pool no room (limit 0).

The price is resident memory: the buffers stay with the process between uses. On the wide
benchmark model peak RSS went from 940 to 1195 MiB per rank; `bench/copy_costs.py --model wide`
unpacks a gather in 86.8 ms into fresh memory and in 14.4 ms into reused memory.

When is a buffer free? When nothing but the pool holds its storage. `take` hands out a view, so
every user (a param's .data, an in-flight Work, a tensor autograd saved for backward, a slice
kept in a dict) holds a reference to the storage, and the pool reuses a buffer only once its
storage's use count says they are all gone. Nobody returns buffers by hand, so none can be
returned too early: a param freed by the core whose old value autograd still holds keeps its
buffer out of the pool until backward lets go.

Bounded: at most `limit_bytes` are kept (the interpreter sizes it by what the live budget can
need, not by the model); past it the least recently used free buffers go, and a request that
still does not fit gets a plain, untracked tensor. Released: `trim()` at each accumulation
boundary drops the free buffers the window did not take, and a miss first drops the free ones
not taken since the last boundary, so the first step's per-module sizes (before the trace
batches gathers) are gone before the traced step's sizes are made, not after its peak.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

Key = tuple[int, torch.dtype]


def _users(t: torch.Tensor) -> int:
    """References to t's storage besides t itself (views, saved tensors, in-flight work)."""
    storage = t.untyped_storage()  # the wrapper counts one
    return torch._C._storage_Use_Count(storage._cdata) - 2


class BufferPool:
    def __init__(self, device: torch.device, limit_bytes: int) -> None:
        self.device, self.limit = device, limit_bytes
        self.buffers: "OrderedDict[Key, list[torch.Tensor]]" = OrderedDict()  # LRU key order
        self.bytes = 0
        self.hits = self.misses = 0
        self.taken: set[int] = set()  # id of each buffer handed out since the last trim

    def trim(self, stale_only: bool = False) -> int:
        """Drop the free buffers nobody took since the last trim (the sizes of a step that will
        not come again: the first step's per-module gathers before the trace). -> bytes dropped."""
        dropped = 0
        for key in list(self.buffers):
            keep = []
            for t in self.buffers[key]:
                if id(t) not in self.taken and _users(t) == 0:
                    dropped += t.numel() * t.element_size()
                else:
                    keep.append(t)
            if keep:
                self.buffers[key] = keep
            else:
                del self.buffers[key]
        self.bytes -= dropped
        if not stale_only:
            self.taken.clear()
        return dropped

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A (numel,) tensor of dtype, contents undefined, that nobody else is using."""
        key = (numel, dtype)
        held = self.buffers.get(key)
        if held is not None:
            self.buffers.move_to_end(key)
            for t in held:
                if _users(t) == 0:
                    self.hits += 1
                    self.taken.add(id(t))
                    return t.view(-1)
        self.misses += 1
        self.trim(stale_only=True)
        t = torch.empty(numel, dtype=dtype, device=self.device)
        size = numel * t.element_size()
        if self._make_room(size):
            self.buffers.setdefault(key, []).append(t)
            self.bytes += size
            self.taken.add(id(t))
        return t.view(-1)

    def _make_room(self, size: int) -> bool:
        """Drop free buffers, least recently used keys first, until `size` more bytes fit; drop
        none if even that would not make room."""
        if self.bytes + size <= self.limit:
            return True
        free = sum(t.numel() * t.element_size() for held in self.buffers.values() for t in held
                   if _users(t) == 0)
        if self.bytes - free + size > self.limit:
            return False
        for key in list(self.buffers):
            if self.bytes + size <= self.limit:
                break
            held = self.buffers[key]
            for t in [t for t in held if _users(t) == 0]:
                held[:] = [h for h in held if h is not t]  # by identity: a tensor's == is elementwise
                self.bytes -= t.numel() * t.element_size()
                if self.bytes + size <= self.limit:
                    break
            if not held:
                del self.buffers[key]
        return self.bytes + size <= self.limit

    def stats(self) -> dict[str, int]:
        return {"pool_bytes": self.bytes, "pool_hits": self.hits, "pool_misses": self.misses}
