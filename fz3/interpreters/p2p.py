"""All-gather and reduce-scatter written as point-to-point sends, param by param, for gloo.

    all_gather      each param's shard -> every peer, received straight into the peers' ranges
                    of the param's full value (no packed buffer, no unpack copy)
    reduce_scatter  partition j of each grad -> rank j, straight from the grad; at the end the
                    received partitions are added, peer after peer in rank order, into this
                    rank's own partition in place (no packed buffer, no output buffer)

Direct exchange: every rank posts all its receives and sends at once, the bytes a ring moves
((W - 1)/W of the params). Padding never travels: partition j of a param of n elements is its
elements [j*s, (j+1)*s) clipped to n, s = ceil(n / W) (fz3.data.layout). On gloo (torch 2.13,
2 ranks here) this is faster than gloo's own collectives and than the all-reduce stand-ins, and
needs no staging buffers (bench/gloo_collectives.py; bench/RESULTS.md, "point-to-point gloo
collectives").

Every rank issues the same effects in the same order (SPMD), so one tag per operation, from a
counter each interpreter keeps, names both ends; messages between two ranks under one tag match
in the order they were posted, which is param order on both sides.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from fz3.core.spec import shard_numel
from fz3.data.layout import rank_span
from fz3.interpreters.transport import PeerFailed, Transport


class P2PWork:
    """Several sends and receives, waited as one; `peers[i]` is the rank works[i] talks to, so
    a failed wait names it (PeerFailed)."""

    __slots__ = ("works", "peers")

    def __init__(self, works: list, peers: list[int]) -> None:
        self.works, self.peers = works, peers

    def wait(self) -> bool:
        for w, j in zip(self.works, self.peers):
            try:
                w.wait()
            except RuntimeError as e:
                raise PeerFailed(j, e) from e
        self.works, self.peers = [], []
        return True


def all_gather(fulls: Sequence[torch.Tensor], shards: Sequence[torch.Tensor], comm: Transport, *,
               tag: int) -> P2PWork:
    """fulls[i] (n_i,) gets param i's full value, shards[i] (s_i,) being this rank's shard."""
    rank, world_size = comm.rank, comm.world_size
    peers = [j for j in range(world_size) if j != rank]
    mine = []
    for full, shard in zip(fulls, shards):
        lo, hi = rank_span(full.numel(), rank, world_size)
        full[lo:hi].copy_(shard[:hi - lo])
        mine.append(shard[:hi - lo])
    works, ends = [], []
    for j in peers:
        for full in fulls:
            lo, hi = rank_span(full.numel(), j, world_size)
            if hi > lo:
                works.append(comm.irecv(full[lo:hi], j, tag))
                ends.append(j)
    for j in peers:
        for m in mine:
            if m.numel():
                works.append(comm.isend(m, j, tag))
                ends.append(j)
    return P2PWork(works, ends)


def reduce_scatter(grads: Sequence[torch.Tensor], scratch: torch.Tensor, comm: Transport, *,
                   tag: int) -> tuple[P2PWork, Callable[[], list[torch.Tensor]]]:
    """SUM over ranks of this rank's partition of each flat grad (n_i,). `scratch` holds the
    peers' partitions: (W - 1) * scratch_numel(...) elements. -> (work, result): after the work
    is waited, result() adds them into the grads' own partitions (written in place) and returns
    the partitions, zero-padded to s_i."""
    rank, world_size = comm.rank, comm.world_size
    peers = [j for j in range(world_size) if j != rank]
    own = [g[slice(*rank_span(g.numel(), rank, world_size))] for g in grads]
    works, ends, got, off = [], [], [], 0
    for j in peers:
        for o in own:
            n = o.numel()
            got.append(scratch[off:off + n])
            off += n
            if n:
                works.append(comm.irecv(got[-1], j, tag))
                ends.append(j)
    for j in peers:
        for g in grads:
            lo, hi = rank_span(g.numel(), j, world_size)
            if hi > lo:
                works.append(comm.isend(g[lo:hi], j, tag))
                ends.append(j)

    def result() -> list[torch.Tensor]:
        for k, o in enumerate(own * len(peers)):  # peer after peer, in rank order
            o.add_(got[k])
        pads = [shard_numel(g.numel(), world_size) - o.numel() for o, g in zip(own, grads)]
        return [F.pad(o, (0, pad)) if pad else o for o, pad in zip(own, pads)]  # pad: a copy
    return P2PWork(works, ends), result


def scratch_numel(numels: Sequence[int], rank: int, world_size: int) -> int:
    """Elements `reduce_scatter` receives: this rank's partition of each param, per peer."""
    mine = sum(hi - lo for lo, hi in (rank_span(n, rank, world_size) for n in numels))
    return (world_size - 1) * mine
