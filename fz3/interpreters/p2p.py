"""All-gather and reduce-scatter written as point-to-point sends, for gloo.

    all_gather      each param's shard -> every peer, received straight into the peers' ranges
                    of the param's full value (no packed buffer, no unpack copy)
    reduce_scatter  partition j of each grad -> rank j, straight from the grad; at the end the
                    received partitions are added, peer after peer in rank order, into this
                    rank's own partition in place (no packed buffer, no output buffer)

One message per peer per message group (fz3.interpreters.messages.groups): a large param travels alone,
from and into where it lies; the small params of one collective travel together, staged into one
buffer on each side (a send costs ~30 us on gloo here whatever its size, issue #27).

Direct exchange: every rank posts all its receives and sends at once, the bytes a ring moves
((W - 1)/W of the params). Padding never travels: partition j of a param of n elements is its
elements [j*s, (j+1)*s) clipped to n, s = ceil(n / W) (fz3.data.layout). On gloo (torch 2.13,
2 ranks here) this is faster than gloo's own collectives and than the all-reduce stand-ins, and
large params need no staging buffers (bench/diagnostics/gloo_collectives.py; bench/RESULTS.md, "point-to-point gloo
collectives").

Every rank issues the same effects in the same order (SPMD), so one tag per operation, from a
counter each interpreter keeps, names both ends; messages between two ranks under one tag match
in the order they were posted, which is group order on both sides.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from fz3.core.spec import shard_numel
from fz3.data.layout import rank_span
from fz3.interpreters.transport import PeerFailed, Transport


class P2PWork:
    """Several sends and receives, waited as one; `peers[i]` is the rank works[i] talks to, so
    a failed wait names it (PeerFailed). `then` runs once they all completed (a packed group's
    receive copied out into its params); `keep` holds the staging buffers until then; `sends`:
    how many of the works are sends (the messages this rank posted)."""

    __slots__ = ("works", "peers", "then", "keep", "sends")

    def __init__(self, works: list, peers: list[int], then: Optional[Callable[[], None]] = None,
                 keep: Sequence[torch.Tensor] = (), sends: int = 0) -> None:
        self.works, self.peers, self.then, self.keep, self.sends = works, peers, then, keep, sends

    def wait(self) -> bool:
        for w, j in zip(self.works, self.peers):
            try:
                w.wait()
            except RuntimeError as e:
                raise PeerFailed(j, e) from e
        self.works, self.peers = [], []
        if self.then is not None:
            then, self.then = self.then, None
            then()
        self.keep = ()
        return True


Take = Callable[[int, torch.dtype], torch.Tensor]


def _packed(parts: Sequence[torch.Tensor], take: Take) -> torch.Tensor:
    """One message of `parts`: the part itself when there is one, else a staging copy."""
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts, out=take(sum(t.numel() for t in parts), parts[0].dtype))


def _defaults(groups, take, n: int):
    """No groups: one message per param; no take: staging buffers are fresh tensors."""
    if groups is None:
        groups = tuple((i,) for i in range(n))
    return groups, take or (lambda numel, dtype: torch.empty(numel, dtype=dtype))


class GatherPlan:
    """What a GatherLayout needs of the params' sizes alone: this rank's span of each, and per
    peer per message group the spans it receives. The trace gathers the same params every step
    into new full values, so the carrier makes this once per param set (issue #48: ~1.7 ms of
    the deep narrow GPT's step, every param sharded, went to making it again)."""

    __slots__ = ("own", "own_numel", "peers", "receives")

    def __init__(self, numels: Sequence[int], rank: int, world_size: int, groups: Sequence[Sequence[int]]) -> None:
        self.own = [rank_span(n, rank, world_size) for n in numels]
        self.own_numel = [hi - lo for lo, hi in self.own]
        self.peers = [j for j in range(world_size) if j != rank]
        # per peer per group with elements: (peer, numel, alone (one param) or packed, [(i, lo, hi) ...])
        self.receives: list[tuple[int, int, bool, list[tuple[int, int, int]]]] = []
        for j in self.peers:
            for g in groups:
                spans = [(i, *rank_span(numels[i], j, world_size)) for i in g]
                n = sum(hi - lo for _, lo, hi in spans)
                if n:
                    self.receives.append((j, n, len(g) == 1, spans))


class GatherLayout:
    """Where `all_gather` puts every byte for given full values: this rank's span of each, and
    per peer per message group the span it receives into (a group of one param) or the spans a
    staged group is copied out to. Made from the full values and their plan (GatherPlan), so a
    gather into the same full values again (the step's refresh of the persistent params,
    effects.Refresh) reuses it: none of its ~5 slices and spans per param are made again
    (issue #27: 980 rank_span calls a step on the deep narrow GPT)."""

    __slots__ = ("fulls", "groups", "own", "own_numel", "peers", "receives")

    def __init__(self, fulls: Sequence[torch.Tensor], rank: int, world_size: int,
                 groups: Sequence[Sequence[int]], plan: Optional[GatherPlan] = None) -> None:
        if plan is None:
            plan = GatherPlan([f.numel() for f in fulls], rank, world_size, groups)
        self.fulls, self.groups = list(fulls), groups
        self.own = [f[lo:hi] for f, (lo, hi) in zip(fulls, plan.own)]
        self.own_numel = plan.own_numel
        self.peers = plan.peers
        # per peer per group with elements: (peer, numel, the full's span it lands in (alone) or
        # None (packed), the spans a packed group is copied out to)
        self.receives: list[tuple[int, int, Optional[torch.Tensor], list[torch.Tensor]]] = []
        for j, n, alone, spans in plan.receives:
            parts = [fulls[i][lo:hi] for i, lo, hi in spans]
            self.receives.append((j, n, parts[0] if alone else None, parts))

    def same_fulls(self, fulls: Sequence[torch.Tensor]) -> bool:
        """Made for these very full values (the same tensors, in order)."""
        return len(fulls) == len(self.fulls) and all(a is b for a, b in zip(fulls, self.fulls))

    def run(self, shards: Sequence[torch.Tensor], comm: Transport, *, tag: int, take: Take) -> P2PWork:
        mine = [shard[:n] for shard, n in zip(shards, self.own_numel)]
        torch._foreach_copy_(self.own, mine)
        works, ends, keep, dsts, srcs = [], [], [], [], []
        sends = 0
        for j, n, alone, parts in self.receives:
            into = alone if alone is not None else take(n, parts[0].dtype)
            works.append(comm.irecv(into, j, tag))
            ends.append(j)
            if alone is None:
                keep.append(into)
                dsts += parts
                srcs += into.split([t.numel() for t in parts])
        for g in self.groups:
            out = _packed([mine[i] for i in g], take)
            if out.numel():
                keep.append(out)
                for j in self.peers:
                    works.append(comm.isend(out, j, tag))
                    ends.append(j)
                    sends += 1
        then = (lambda: torch._foreach_copy_(dsts, srcs)) if dsts else None
        return P2PWork(works, ends, then, keep, sends)


def all_gather(fulls: Sequence[torch.Tensor], shards: Sequence[torch.Tensor], comm: Transport, *,
               tag: int, groups: Optional[Sequence[Sequence[int]]] = None, take: Optional[Take] = None,
               layout: Optional[GatherLayout] = None) -> P2PWork:
    """fulls[i] (n_i,) gets param i's full value, shards[i] (s_i,) being this rank's shard.
    One message per peer per group of `groups` (fz3.interpreters.messages): a group of one param is
    received in place, a packed one into a staging buffer (from `take`) and copied out after
    the wait. No groups: each param alone. `layout`: made before for these fulls and groups."""
    groups, take = _defaults(groups, take, len(fulls))
    if layout is None:
        layout = GatherLayout(fulls, comm.rank, comm.world_size, groups)
    return layout.run(shards, comm, tag=tag, take=take)


class ReduceLayout:
    """Where `reduce_scatter` takes and puts every byte for grads of given sizes, as offsets: this
    rank's span of each grad, per peer per message group the block of the scratch it receives
    and the grads' spans it sends. Only sizes: the grads are new tensors at every backward, but
    a bucket's sizes repeat every step, so the carrier keeps the layout per bucket (made once:
    no rank_span, no sums at each reduce)."""

    __slots__ = ("own", "receives", "sends", "some", "pads", "scratch_numel")

    def __init__(self, numels: Sequence[int], rank: int, world_size: int, groups: Sequence[Sequence[int]]) -> None:
        spans = [[rank_span(n, j, world_size) for j in range(world_size)] for n in numels]
        self.own = [sp[rank] for sp in spans]
        sizes = [hi - lo for lo, hi in self.own]
        # per peer per group with elements: (peer, scratch offset, elements, [(grad, offset, elements) ...])
        self.receives: list[tuple[int, int, int, list[tuple[int, int, int]]]] = []
        self.sends: list[tuple[int, list[tuple[int, int, int]]]] = []  # (peer, [(grad, lo, hi) ...])
        off = 0
        for j in range(world_size):
            if j == rank:
                continue
            for g in groups:
                n = sum(sizes[i] for i in g)
                if n:
                    at = []
                    for i in g:
                        at.append((i, off, sizes[i]))
                        off += sizes[i]
                    self.receives.append((j, off - n, n, at))
        self.scratch_numel = off  # what the peers' partitions take (scratch_numel below)
        for j in range(world_size):
            if j == rank:
                continue
            for g in groups:
                parts = [(i, *spans[i][j]) for i in g]
                if sum(hi - lo for _, lo, hi in parts):
                    self.sends.append((j, parts))
        self.some = [i for i, n in enumerate(sizes) if n]
        self.pads = [shard_numel(n, world_size) - k for n, k in zip(numels, sizes)]

    def run(self, grads: Sequence[torch.Tensor], scratch: torch.Tensor, comm: Transport, *, tag: int,
            take: Take) -> tuple[P2PWork, Callable[[], list[torch.Tensor]]]:
        own = [g[lo:hi] for g, (lo, hi) in zip(grads, self.own)]
        works, ends, keep = [], [], []
        got: list[dict[int, torch.Tensor]] = []  # per peer, per grad with elements: its slice of the scratch
        peer, mine = None, None
        for j, off, n, at in self.receives:
            works.append(comm.irecv(scratch[off:off + n], j, tag))
            ends.append(j)
            if j != peer:
                peer, mine = j, {}
                got.append(mine)
            for i, o, k in at:
                mine[i] = scratch[o:o + k]
        for j, parts in self.sends:
            out = _packed([grads[i][lo:hi] for i, lo, hi in parts], take)
            keep.append(out)
            works.append(comm.isend(out, j, tag))
            ends.append(j)
        some, pads = self.some, self.pads

        def result() -> list[torch.Tensor]:
            for mine in got if some else ():  # peer after peer, in rank order
                torch._foreach_add_([own[i] for i in some], [mine[i] for i in some])
            return [F.pad(o, (0, pad)) if pad else o for o, pad in zip(own, pads)]  # pad: a copy
        return P2PWork(works, ends, None, keep, len(self.sends)), result


def reduce_scatter(grads: Sequence[torch.Tensor], scratch: torch.Tensor, comm: Transport, *,
                   tag: int, groups: Optional[Sequence[Sequence[int]]] = None,
                   take: Optional[Take] = None,
                   layout: Optional[ReduceLayout] = None) -> tuple[P2PWork, Callable[[], list[torch.Tensor]]]:
    """SUM over ranks of this rank's partition of each flat grad (n_i,). `scratch` holds the
    peers' partitions: (W - 1) * scratch_numel(...) elements, one block per peer per group of
    `groups` (fz3.interpreters.messages), each received by one message; a peer's slices of a packed
    group are staged into one send. -> (work, result): after the work is waited, result() adds
    them into the grads' own partitions (written in place) and returns the partitions,
    zero-padded to s_i. `layout`: made before for grads of these sizes and these groups."""
    groups, take = _defaults(groups, take, len(grads))
    if layout is None:
        layout = ReduceLayout([g.numel() for g in grads], comm.rank, comm.world_size, groups)
    return layout.run(grads, scratch, comm, tag=tag, take=take)


def scratch_numel(numels: Sequence[int], rank: int, world_size: int) -> int:
    """Elements `reduce_scatter` receives: this rank's partition of each param, per peer."""
    mine = sum(hi - lo for lo, hi in (rank_span(n, rank, world_size) for n in numels))
    return (world_size - 1) * mine
