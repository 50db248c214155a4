"""Reusable flat buffers for the collectives: all-gather inputs and outputs, the params' full
values, reduce-scatter inputs and outputs, the point-to-point receive scratch.

Why: every step asks for the same buffer sizes (the trace repeats), and a fresh large tensor on
CPU is fresh memory from the OS, page-faulted on first write: about 0.8 ms per MiB here, more
than the copy itself (bench/RESULTS.md, "fz3 data-plane copies"). On an accelerator the caching
allocator already reuses memory, and the interpreter gives the pool no room (limit 0).

The price is resident memory, and ZeRO-3 exists to save it: a buffer kept between uses is
resident through the backward's peak. So the pool keeps a buffer only for a take of the same
pass: the core marks a Free `refetch` when the releasing module's backward gathers the params
again (max_reuse_distance 0: the forward's buffers serve the backward's gathers); any other
Free drops its params' buffers from the pool at once (`discard`), and the end of each backward
drops every free buffer (`release`). Between passes the pool holds only what is in use, and
not even that once it has been in use through a whole pass ([Note: resident buffers]). Issue
#11: keeping every buffer between steps held 168 MiB per rank on the wide benchmark GPT and put
its peak RSS above FSDP2's; the next forward now page-faults its gather buffers again
(`bench/copy_costs.py --model wide`: an unpack into fresh memory 86.8 ms, into reused memory
14.4 ms).

When is a buffer free? When nothing but the pool holds its storage. `take` hands out a view, so
every user (a param's .data, an in-flight Work, a tensor autograd saved for backward, a slice
kept in a dict) holds a reference to the storage, and the pool reuses a buffer only once its
storage's use count says they are all gone. Nobody returns buffers by hand, so none can be
returned too early: a param freed by the core whose old value autograd still holds keeps its
buffer out of the pool until backward lets go.

Bounded: at most `limit_bytes` are kept (the interpreter sizes it by what the live budget can
need, not by the model); past it the least recently used free buffers go, and a request that
still does not fit gets a plain, untracked tensor. A miss first drops the free buffers not taken
since the last `trim()`, so sizes that will not come again do not stay.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch

from fz3.data.pages import advise_huge

Key = tuple[int, torch.dtype]

MIN_POOLED_BYTES = 1 << 16
"""[Note: small buffers unpooled] What the pool saves is the page faults of fresh memory from the
OS. A buffer below glibc's mmap threshold (128 KiB unless tuned) comes from the heap, where the
allocator reuses freed chunks itself: pooling a param's full value that small saved nothing and
cost its bookkeeping, a take and a discard per param (the deep narrow GPT, every param sharded:
196 params of at most 16 KiB, ~1.5 ms of a 37 ms step on one rank, issue #48). The interpreter
pools full values from 64 KiB; a collective's scratch (one a collective) whatever its size."""


def _users(t: torch.Tensor) -> int:
    """References to t's storage besides t itself (views, saved tensors, in-flight work)."""
    storage = t.untyped_storage()  # the wrapper counts one
    return torch._C._storage_Use_Count(storage._cdata) - 2


class BufferPool:
    """[Note: pool bookkeeping] What the pool keeps is indexed three ways, so no take, miss or
    discard walks the buffers: `buffers` by size (LRU order of sizes), `by_ptr` by storage
    pointer (a discard finds its buffer at once), and `untaken` (the buffers not handed out since
    the last full trim, oldest first: a miss drops the free ones among them, which are the only
    candidates). The buffers of one size are a queue in the order they were last looked at: a
    take asks the one at the front whether anybody uses it (`_users`) and sends it to the back
    either way, so a buffer handed out is asked again only after every other one of its size.
    A size can be held by many buffers (a model of many equal params keeps each one's full
    value: 98 of 32 elements on the deep narrow GPT), and asking every one at each take cost
    25 us a take there; the queue finds the free ones at its front, where the last frees left
    them.

    [Note: resident buffers] A buffer in use at two ends of backward in a row, and not handed
    out between them (still `untaken`), is resident: a persistent param's full value, gathered
    once and refreshed in place at every step, which lives to the end. The pool stops keeping it
    (`release`), as `discard` does: its user owns it, and its memory goes back when the user
    lets go, as any tensor's. Kept, each end of backward asked every one of them again (196 on
    the deep narrow GPT, issue #27), and they took up the pool's limit. One in use at one end
    only, or taken again between the two (a param's full value, freed and gathered again),
    stays kept."""

    def __init__(self, device: torch.device, limit_bytes: int, huge_pages: bool = False, min_bytes: int = 0) -> None:
        self.device, self.limit = device, limit_bytes
        self.min_bytes = min_bytes  # a smaller full value is a plain tensor: [Note: small buffers unpooled]
        self.huge_pages = huge_pages  # a new buffer of 32 MiB or more: [Note: huge pages for fresh buffers]
        # LRU key order; per size, id -> buffer, in the order last looked at (oldest first)
        self.buffers: "OrderedDict[Key, OrderedDict[int, torch.Tensor]]" = OrderedDict()
        self.by_ptr: dict[int, torch.Tensor] = {}  # storage data_ptr -> the buffer kept on it
        self.untaken: dict[int, torch.Tensor] = {}  # id -> buffer not taken since the last trim()
        self.bytes = 0
        self.hits = self.misses = 0

    def _keep(self, key: Key, t: torch.Tensor) -> None:
        held = self.buffers.get(key)
        if held is None:
            held = self.buffers[key] = OrderedDict()
        held[id(t)] = t
        ptr = t.untyped_storage().data_ptr()
        if ptr:  # an empty buffer has no storage to find it by
            self.by_ptr[ptr] = t
        self.bytes += t.numel() * t.element_size()

    def _drop(self, t: torch.Tensor) -> int:
        """Stop keeping buffer `t` (kept). -> its bytes."""
        key = (t.numel(), t.dtype)
        held = self.buffers[key]
        del held[id(t)]  # by identity: a tensor's == is elementwise
        if not held:
            del self.buffers[key]
        ptr = t.untyped_storage().data_ptr()
        if ptr and self.by_ptr.get(ptr) is t:
            del self.by_ptr[ptr]
        self.untaken.pop(id(t), None)
        size = t.numel() * t.element_size()
        self.bytes -= size
        return size

    def trim(self, stale_only: bool = False) -> int:
        """Drop the free buffers nobody took since the last trim (the sizes of a step that will
        not come again: the first step's per-module gathers before the trace). Without
        `stale_only` this starts a new window: every buffer kept counts as not taken yet.
        -> bytes dropped."""
        dropped = sum(self._drop(t) for t in [t for t in self.untaken.values() if _users(t) == 0])
        if not stale_only:
            self.untaken = {id(t): t for held in self.buffers.values() for t in held.values()}
        return dropped

    def discard(self, t: torch.Tensor) -> int:
        """Stop keeping the buffer `t` lies in (its users still hold it; when the last lets go,
        the memory goes back). -> bytes no longer kept."""
        ptr = t.untyped_storage().data_ptr()
        b = self.by_ptr.get(ptr) if ptr else None
        return self._drop(b) if b is not None else 0

    def release(self) -> int:
        """Drop every free buffer (the end of a backward: nothing is taken again before the next
        pass), and stop keeping the ones in use at this end and the one before ([Note: resident
        buffers]). -> bytes dropped (the free ones')."""
        dropped, busy = 0, {}
        for held in list(self.buffers.values()):
            for i, t in list(held.items()):
                if _users(t) == 0:
                    dropped += self._drop(t)
                elif i in self.untaken:  # in use at the last release, not taken since: resident
                    self._drop(t)
                else:
                    busy[i] = t
        self.untaken = busy
        return dropped

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A (numel,) tensor of dtype, contents undefined, that nobody else is using: pooled
        whatever its size (a collective's scratch, one a collective)."""
        got = self._free_of((numel, dtype), 1)
        if got:
            return got[0]
        self.trim(stale_only=True)
        return self._fresh(numel, dtype)

    def take_many(self, numels: Sequence[int], dtype: torch.dtype) -> list[torch.Tensor]:
        """`take` of each of `numels` (one gather's full values), each size's buffers asked at
        most once for the whole batch ([Note: pool bookkeeping]): taken one at a time, each
        take asked again every buffer the batch's earlier takes of its size had just handed
        out, all in use, which cost the deep narrow GPT, every param sharded, 4,753 asks and
        ~6 ms a step (98 params of 32 elements in one gather, issue #48). A value below
        `min_bytes` is a plain tensor ([Note: small buffers unpooled])."""
        out: list = [None] * len(numels)
        wanted: dict[int, list[int]] = {}
        small = self.min_bytes // dtype.itemsize
        for i, n in enumerate(numels):
            if n < small:  # [Note: small buffers unpooled]
                out[i] = torch.empty(n, dtype=dtype, device=self.device)
            else:
                wanted.setdefault(n, []).append(i)
        missed: list[int] = []
        for numel, slots in wanted.items():
            got = self._free_of((numel, dtype), len(slots))
            for i, t in zip(slots, got):
                out[i] = t
            missed += slots[len(got):]
        if missed:
            self.trim(stale_only=True)
            for i in missed:
                out[i] = self._fresh(numels[i], dtype)
        return out

    def _free_of(self, key: Key, most: int) -> list[torch.Tensor]:
        """Up to `most` free buffers of size `key`, each asked once, from the front of its
        queue; each one asked goes to the back."""
        held = self.buffers.get(key)
        if held is None:
            return []
        self.buffers.move_to_end(key)
        got = []
        for _ in range(len(held)):  # [Note: pool bookkeeping]: the front, to the back
            if len(got) == most:
                break
            i = next(iter(held))
            held.move_to_end(i)
            t = held[i]
            if _users(t) == 0:
                self.hits += 1
                self.untaken.pop(i, None)
                got.append(t.view(-1))  # the view is a user: asked again, it is in use
        return got

    def _fresh(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A miss: a new buffer, kept if it fits."""
        self.misses += 1
        t = torch.empty(numel, dtype=dtype, device=self.device)
        if self.huge_pages:
            advise_huge(t)
        if self._make_room(numel * t.element_size()):
            self._keep((numel, dtype), t)
        return t.view(-1)

    def _make_room(self, size: int) -> bool:
        """Drop free buffers, least recently used keys first, until `size` more bytes fit; drop
        none if even that would not make room."""
        if self.bytes + size <= self.limit:
            return True
        free = sum(t.numel() * t.element_size() for held in self.buffers.values() for t in held.values()
                   if _users(t) == 0)
        if self.bytes - free + size > self.limit:
            return False
        for key in list(self.buffers):
            if self.bytes + size <= self.limit:
                break
            for t in [t for t in self.buffers[key].values() if _users(t) == 0]:
                self._drop(t)
                if self.bytes + size <= self.limit:
                    break
        return self.bytes + size <= self.limit

    def kept(self, key: Key | None = None) -> list[torch.Tensor]:
        """The buffers kept (of size `key` only, if given), in use or not."""
        helds = self.buffers.values() if key is None else [self.buffers.get(key, {})]
        return [t for held in helds for t in held.values()]

    def stats(self) -> dict[str, int]:
        return {"pool_bytes": self.bytes, "pool_hits": self.hits, "pool_misses": self.misses}
