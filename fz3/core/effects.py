"""Effects: small frozen records describing data-plane work. The core returns them; interpreters
(the real torch.distributed one, the recorder, the simulated world) carry them out.

Pure data: printable, comparable, hashable. Every rank computes the same effects in the same
order (I6), so the collectives they describe line up across ranks.
"""
from __future__ import annotations

from dataclasses import dataclass

from fz3.core.ids import Handle, ParamId

# ---- parameter lifecycle -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AllGather:
    """Start one flat all-gather of these params' shards (sorted by id) as in-flight `handle`.

    Afterwards the params are INFLIGHT: nobody may read them before `Wait(handle)`.
    DeepSpeed: `all_gather_coalesced` on the allgather stream.
    """

    handle: Handle
    params: tuple[ParamId, ...]
    prefetch: bool  # issued ahead of need from the trace (not for the module being fetched)
    forward: bool  # forward or backward phase (counter labels only)


@dataclass(frozen=True, slots=True)
class Wait:
    """Block until the gather `handle` is done; its params become AVAILABLE.

    On a device: the compute stream waits on the gather stream (no host sync).
    """

    handle: Handle


@dataclass(frozen=True, slots=True)
class Free:
    """Drop these params' full values; only the shards stay. DeepSpeed: `partition()`."""

    params: tuple[ParamId, ...]


# ---- gradient lifecycle --------------------------------------------------------------------
