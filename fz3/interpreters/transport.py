"""How the interpreter's bytes move between ranks: a transport, chosen once, injected.

    TorchTransport(group)         torch.distributed on a process group (gloo, nccl, hccl):
                                  what fz3.initialize runs
    ThreadTransport(world, rank)  one rank of a ThreadWorld: N ranks as threads of one process,
                                  messages handed over in memory (fz3/interpreters/threads.py)

The interpreter (dist.py), its point-to-point carrier (p2p.py) and the divergence check
(agreement.py) speak only this interface, so the same engine and interpreter run on real
process groups and on N ranks in one process (engine-level tests without launching
processes; issue #12). Every reduction is a SUM. Work objects have `wait(timeout=None)` (a
datetime.timedelta; RuntimeError when it passes, or when the peer's end is gone) and
`is_completed()`; a wait without a timeout gives up after the transport's own `timeout()`.
"""
from __future__ import annotations

import datetime
from typing import Optional, Protocol

import torch
import torch.distributed as dist

from fz3.data.collectives import ALL_GATHER, REDUCE_SCATTER


class PeerFailed(RuntimeError):
    """A wait on messages to or from rank `peer` failed (`error`: what the transport raised):
    its connection closed, or the wait timed out. Point-to-point work raises it so that the
    divergence check can name the rank (fz3/interpreters/agreement.py)."""

    def __init__(self, peer: int, error: BaseException) -> None:
        super().__init__(f"rank {peer}: {type(error).__name__}: {error}")
        self.peer, self.error = peer, error


class Work(Protocol):
    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool: ...
    def is_completed(self) -> bool: ...


class Transport(Protocol):
    rank: int
    world_size: int
    backend: str  # "gloo", "nccl", "hccl" or "threads"

    def isend(self, t: torch.Tensor, dst: int, tag: int) -> Work:
        """Send `t` to rank `dst`; `t` must stay unchanged until the work completes."""

    def irecv(self, t: torch.Tensor, src: int, tag: int) -> Work:
        """Receive into `t` from rank `src`. Messages between two ranks under one tag match in
        the order they were posted."""

    def all_reduce(self, t: torch.Tensor, async_op: bool = False) -> Optional[Work]: ...

    def all_gather_into(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False) -> Optional[Work]:
        """out (W * n,) = every rank's inp (n,), in rank order."""

    def reduce_scatter_into(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False) -> Optional[Work]:
        """out (n,) = this rank's n-element block of the SUM over ranks of inp (W * n,)."""

    def broadcast(self, t: torch.Tensor, src: int = 0) -> None:
        """Every rank's `t` = rank `src`'s (a rank of this transport's group)."""

    def timeout(self) -> datetime.timedelta:
        """How long a wait gives up after when given no timeout: the process group's own (what
        init_process_group or new_group was given; torch's default, 30 minutes, if none)."""

    def side(self) -> "Transport":
        """A transport for the divergence check's descriptors: this one where its point-to-point
        messages have tags (gloo, threads); a gloo side group otherwise (NCCL and HCCL
        point-to-point messages have none). Every rank must call it."""


class TorchTransport:
    """torch.distributed on `group` (None: the default group)."""

    def __init__(self, group=None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))

    def isend(self, t, dst, tag):
        return dist.isend(t, group=self.group, group_dst=dst, tag=tag)

    def irecv(self, t, src, tag):
        return dist.irecv(t, group=self.group, group_src=src, tag=tag)

    def all_reduce(self, t, async_op=False):
        return dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)

    def all_gather_into(self, out, inp, async_op=False):
        return ALL_GATHER(out, inp, group=self.group, async_op=async_op)

    def reduce_scatter_into(self, out, inp, async_op=False):
        return REDUCE_SCATTER(out, inp, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)

    def broadcast(self, t, src=0):
        dist.broadcast(t, src=dist.get_global_rank(self.group, src) if self.group is not None else src,
                       group=self.group)

    def timeout(self) -> datetime.timedelta:
        """The group's backend options hold it (torch 2.13: ProcessGroupGloo / ProcessGroupNCCL
        `.options._timeout`, set from init_process_group's or new_group's `timeout`)."""
        group = self.group if self.group is not None else dist.distributed_c10d._get_default_group()
        for device in group._device_types:
            t = getattr(getattr(group._get_backend(device), "options", None), "_timeout", None)
            if isinstance(t, datetime.timedelta):
                return t
        return dist.default_pg_timeout

    def side(self) -> "TorchTransport":
        """On NCCL and HCCL, a gloo group with the training group's timeout: the descriptors'
        waits give up when the training group's would."""
        if self.backend == "gloo":
            return self
        if self.group is None:
            return TorchTransport(dist.new_group(backend="gloo", timeout=self.timeout()))
        return TorchTransport(dist.new_group(ranks=dist.get_process_group_ranks(self.group), backend="gloo",
                                             timeout=self.timeout(), use_local_synchronization=True))
