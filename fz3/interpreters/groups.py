"""Hybrid sharding's two axes, and hpZ's group, as transports ([Note: hybrid sharding], [Note:
hpZ], fz3/core/stage.py).

    axes(world, S, H) -> Axes(shard, replica, secondary), or None for one group of the whole
                         world and hpZ off

The world's W ranks form R = W / S groups of S consecutive ranks. A rank's `shard` transport is
its group (the gathers and the in-group reduces); its `replica` transport is the R ranks that
hold the same shard, one per group (the reduce across groups). hpZ's group is H consecutive
ranks (the backward's gathers of secondary shards). Ranks of each are numbered
0.. in world order. Every rank must call `axes`, in the same order as every other collective:
on process groups it makes every group (torch.distributed.new_group is itself collective).
"""
from __future__ import annotations

import datetime
import itertools
import os
from typing import NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from fz3.interpreters.threads import ThreadTransport, _Done, _sum
from fz3.interpreters.transport import TorchTransport, Transport


def launcher_nodes(world_size: int) -> Optional[int]:
    """The ranks of each node as the launcher says them (torchrun's LOCAL_WORLD_SIZE), when the
    world spans several whole nodes; else None (one node, or nothing said)."""
    node = os.environ.get("LOCAL_WORLD_SIZE", "")
    n = int(node) if node.isdigit() else 0
    return n if 0 < n < world_size and world_size % n == 0 else None


class Axes(NamedTuple):
    shard: Transport  # this rank's group of S consecutive ranks (the world, when flat)
    replica: Optional[Transport]  # the R ranks holding this rank's shard (None, when flat)
    secondary: Optional[Transport] = None  # hpZ: this rank's group of H consecutive ranks
    # ([Note: hpZ], fz3/core/stage.py); None: hpZ off


def members(world_size: int, S: int, rank: int) -> tuple[list[int], list[int]]:
    """The world ranks of `rank`'s group and of its replica set."""
    g, i = divmod(rank, S)
    return [g * S + j for j in range(S)], list(range(i, world_size, S))


def axes(world: Transport, S: int, H: int = 1) -> Optional[Axes]:
    """`S`: the shard group's size (0 or W: flat); `H`: hpZ's (1: off)."""
    W = world.world_size
    hybrid, hpz = bool(S) and S != W, H > 1
    if not hybrid and not hpz:
        return None
    group, replicas = members(W, S, world.rank) if hybrid else (list(range(W)), [world.rank])
    block = members(W, H, world.rank)[0]
    if isinstance(world, ThreadTransport):
        return Axes(SubTransport(world, group, ("shard", group[0])) if hybrid else world,
                    SubTransport(world, replicas, ("replica", replicas[0])) if hybrid else None,
                    SubTransport(world, block, ("hpz", block[0])) if hpz else None)
    if isinstance(world, TorchTransport):
        shard, replica = _process_groups(world, S) if hybrid else (world, None)
        return Axes(shard, replica, _blocks(world, H) if hpz else None)
    raise TypeError(f"fz3: hybrid sharding and hpZ need a process group or thread ranks, not {type(world).__name__}")


def _ranks(world: TorchTransport) -> list[int]:
    return dist.get_process_group_ranks(world.group) if world.group is not None else list(range(world.world_size))


def _blocks(world: TorchTransport, n: int) -> TorchTransport:
    """Every block of `n` consecutive ranks as a process group (each rank makes all of them, in
    one order, as new_group asks); -> this rank's."""
    ranks, mine = _ranks(world), None
    for g in range(world.world_size // n):
        made = dist.new_group(ranks[g * n:(g + 1) * n], backend=world.backend, timeout=world.timeout())
        if world.rank // n == g:
            mine = TorchTransport(made)
    return mine


def _process_groups(world: TorchTransport, S: int) -> tuple[TorchTransport, TorchTransport]:
    """Every group and every replica set as a process group; -> this rank's two."""
    W, ranks = world.world_size, _ranks(world)
    shard, replica = _blocks(world, S), None
    for i in range(S):
        made = dist.new_group([ranks[i + g * S] for g in range(W // S)], backend=world.backend,
                              timeout=world.timeout())
        if world.rank % S == i:
            replica = TorchTransport(made)
    return shard, replica


class SubTransport:
    """Some ranks of a thread world as a transport of their own: rank i is world rank
    members[i]. Its point-to-point messages travel on the world's under tags of its own
    namespace, and its collectives are made of them, each member adding the others' tensors in
    member order (as the world's own collectives add in rank order: every member gets the same
    bits)."""

    backend = "threads"

    def __init__(self, world: ThreadTransport, members: Sequence[int], name: tuple) -> None:
        self.world, self.members, self.name = world, list(members), name
        self.rank, self.world_size = self.members.index(world.rank), len(self.members)
        self.calls = itertools.count()

    def isend(self, t: torch.Tensor, dst: int, tag: int):
        return self.world.isend(t, self.members[dst], (self.name, tag))

    def irecv(self, t: torch.Tensor, src: int, tag: int):
        return self.world.irecv(t, self.members[src], (self.name, tag))

    def _exchange(self, t: torch.Tensor, to: Sequence[int], frm: Sequence[int]) -> dict[int, torch.Tensor]:
        """Send `t` to the members `to`; -> what each member of `frm` sent (one collective)."""
        tag = ("collective", next(self.calls))
        got = {j: torch.empty_like(t) for j in frm}
        works = [self.isend(t, j, tag) for j in to] + [self.irecv(got[j], j, tag) for j in frm]
        for w in works:
            w.wait()
        return got

    def _everyone(self, t: torch.Tensor) -> list[torch.Tensor]:
        others = [j for j in range(self.world_size) if j != self.rank]
        got = self._exchange(t.contiguous(), others, others)
        return [t if j == self.rank else got[j] for j in range(self.world_size)]

    def all_reduce(self, t: torch.Tensor, async_op: bool = False):
        t.copy_(_sum(self._everyone(t)))
        return _done(async_op)

    def all_gather_into(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
        out.copy_(torch.cat([x.reshape(-1) for x in self._everyone(inp)]))
        return _done(async_op)

    def reduce_scatter_into(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
        n = out.numel()
        out.copy_(_sum(self._everyone(inp)).reshape(-1)[self.rank * n:(self.rank + 1) * n])
        return _done(async_op)

    def broadcast(self, t: torch.Tensor, src: int = 0):
        if self.rank == src:
            self._exchange(t, [j for j in range(self.world_size) if j != src], [])
        else:
            t.copy_(self._exchange(t, [], [src])[src])

    def timeout(self) -> datetime.timedelta:
        return self.world.timeout()

    def side(self) -> "SubTransport":
        return self


def _done(async_op: bool):
    return _Done() if async_op else None
