"""All-gather and reduce-scatter written as point-to-point sends, for gloo.

    all_gather      each param's shard -> every peer, received straight into the peers' ranges
                    of the param's full value (no packed buffer, no unpack copy)
    reduce_scatter  partition j of each grad -> rank j, straight from the grad; at the end the
                    received partitions are added, peer after peer in rank order, into this
                    rank's own partition in place (no packed buffer, no output buffer); the
                    small grads of a packed group go as one row per peer, cut from them in one
                    op ([Note: packed groups in rows], ReduceLayout)

One message per peer per message group (fz3.interpreters.messages.groups): a large param travels alone,
from and into where it lies; the small params of one collective travel together, staged into one
buffer on each side (a send costs ~30 us on gloo here whatever its size, issue #27).

Direct exchange: every rank posts all its receives and sends at once, the bytes a ring moves
((W - 1)/W of the params). Padding never travels but in a reduce's packed row (fewer than W
elements a param): partition j of a param of n elements is its elements [j*s, (j+1)*s) clipped
to n, s = ceil(n / W) (fz3.data.layout). On gloo (torch 2.13,
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
    the deep narrow GPT's step, every param sharded, went to making it again). `rows`: each
    packed group as rows ([Note: packed groups in rows], ReduceLayout): its params, their shard
    sizes s_i, S, and the ranks holding an element of one of them (only their rows travel)."""

    __slots__ = ("own", "own_numel", "peers", "receives", "rows", "alone", "alone_receives")

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
        self.rows: list[tuple[tuple[int, ...], list[int], int, list[int]]] = []
        for g in groups:
            if len(g) > 1:
                s_sizes = [shard_numel(numels[i], world_size) for i in g]
                holders = [j for j in range(world_size)
                           if any(rank_span(numels[i], j, world_size)[1] > rank_span(numels[i], j, world_size)[0]
                                  for i in g)]
                self.rows.append((tuple(g), s_sizes, sum(s_sizes), holders))
        in_rows = {i for g, _, _, _ in self.rows for i in g}
        self.alone = [i for i in range(len(numels)) if i not in in_rows]
        self.alone_receives = [r for r in self.receives if r[2]]


def padded_numels(numels: Sequence[int], world_size: int, plan: GatherPlan) -> list[int]:
    """The buffer each full value of a gather by rows takes: W * s_i for a param of a packed
    group (its rows are copied out whole, padding and all), n_i for one alone."""
    out = list(numels)
    for g, s_sizes, _, _ in plan.rows:
        for i, s in zip(g, s_sizes):
            out[i] = world_size * s
    return out


class GatherLayout:
    """Where `all_gather` puts every byte for given full values: this rank's span of each, and
    per peer per message group the span it receives into (a group of one param) or the spans a
    staged group is copied out to. Made from the full values and their plan (GatherPlan), so a
    gather into the same full values again (the step's refresh of the persistent params,
    effects.Refresh) reuses it: none of its ~5 slices and spans per param are made again
    (issue #27: 980 rank_span calls a step on the deep narrow GPT).

    `padded`: the buffers the full values lie in, W * s_i elements for a packed group's params
    (padded_numels): the packed groups then travel as rows, as a reduce's do ([Note: packed
    groups in rows]): this rank's row is its shards of the group in one cat, each peer's row
    comes into a (W, S) staging buffer, and one split_with_sizes_copy cuts the rows into the
    padded buffers (FSDP2's all-gather copy-out), where per param and peer a span was sliced,
    copied in and copied out before."""

    __slots__ = ("fulls", "groups", "own", "own_numel", "peers", "receives", "rows", "alone", "rank",
                 "world_size")

    def __init__(self, fulls: Sequence[torch.Tensor], rank: int, world_size: int,
                 groups: Sequence[Sequence[int]], plan: Optional[GatherPlan] = None,
                 padded: Optional[Sequence[torch.Tensor]] = None) -> None:
        if plan is None:
            plan = GatherPlan([f.numel() for f in fulls], rank, world_size, groups)
        self.fulls, self.groups = list(fulls), groups
        self.rank, self.world_size = rank, world_size
        self.own_numel = plan.own_numel
        self.peers = plan.peers
        self.rows = [] if padded is None else [
            (g, s_sizes, S, holders, [padded[i].view(world_size, s) for i, s in zip(g, s_sizes)])
            for g, s_sizes, S, holders in plan.rows]
        self.alone = plan.alone if self.rows else range(len(fulls))
        self.own = [fulls[i][plan.own[i][0]:plan.own[i][1]] for i in self.alone]
        # per peer per group with elements: (peer, numel, the full's span it lands in (alone) or
        # None (packed), the spans a packed group is copied out to)
        self.receives: list[tuple[int, int, Optional[torch.Tensor], list[torch.Tensor]]] = []
        for j, n, alone, spans in (plan.alone_receives if self.rows else plan.receives):
            parts = [fulls[i][lo:hi] for i, lo, hi in spans]
            self.receives.append((j, n, parts[0] if alone else None, parts))

    def same_fulls(self, fulls: Sequence[torch.Tensor]) -> bool:
        """Made for these very full values (the same tensors, in order)."""
        return len(fulls) == len(self.fulls) and all(a is b for a, b in zip(fulls, self.fulls))

    def run(self, shards: Sequence[torch.Tensor], comm: Transport, *, tag: int, take: Take) -> P2PWork:
        W, rank = self.world_size, self.rank
        works, ends, keep, dsts, srcs, outs = [], [], [], [], [], []
        sends = 0
        for g, s_sizes, S, holders, views in self.rows:
            buf = take(W * S, shards[g[0]].dtype).view(W, S)
            keep.append(buf)
            torch.cat([shards[i] for i in g], out=buf[rank])
            for j in self.peers:
                if j in holders:
                    works.append(comm.irecv(buf[j], j, tag))
                    ends.append(j)
                if rank in holders:
                    works.append(comm.isend(buf[rank], j, tag))
                    ends.append(j)
                    sends += 1
            outs.append((buf, s_sizes, views))
        mine = {i: shards[i][:self.own_numel[i]] for i in self.alone}
        if self.own:
            torch._foreach_copy_(self.own, [mine[i] for i in self.alone])
        for j, n, alone, parts in self.receives:
            into = alone if alone is not None else take(n, parts[0].dtype)
            works.append(comm.irecv(into, j, tag))
            ends.append(j)
            if alone is None:
                keep.append(into)
                dsts += parts
                srcs += into.split([t.numel() for t in parts])
        for g in self.groups:
            if len(g) > 1 and self.rows:  # a packed group: gone as rows above
                continue
            out = _packed([mine[i] for i in g], take)
            if out.numel():
                keep.append(out)
                for j in self.peers:
                    works.append(comm.isend(out, j, tag))
                    ends.append(j)
                    sends += 1

        def then() -> None:
            if dsts:
                torch._foreach_copy_(dsts, srcs)
            for buf, s_sizes, views in outs:
                torch.split_with_sizes_copy(buf, s_sizes, dim=1, out=views)
        return P2PWork(works, ends, then if dsts or outs else None, keep, sends)


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
    no rank_span, no sums at each reduce).

    [Note: packed groups in rows] A packed group (more than one param) is cut in one op, as
    FSDP2's reduce-scatter copy-in: torch._chunk_cat lays each grad's W chunks of its shard size
    s_i, zero-padded, rank-major into a (W, S) staging buffer, S = sum of s_i; row j goes to peer
    j, peer j's row for this rank comes into the scratch, and this rank's row, the peers' added
    in rank order, is its partition of every param of the group, padded, cut by one split. So a
    packed group costs a few ops whatever its params (196 slices, a cat, a foreach add and a pad
    per param on the deep narrow benchmark GPT, every param sharded, were ~3 ms of its step at
    world 2: issue #48), and its padding (fewer than W elements a param) travels with it; the
    sums are the same adds in the same order. A param alone is sent from where it lies and its
    own partition summed in place, as before."""

    __slots__ = ("own", "peers", "receives", "sends", "some", "pads", "scratch_numel", "rows", "rest", "rank",
                 "world_size")

    def __init__(self, numels: Sequence[int], rank: int, world_size: int, groups: Sequence[Sequence[int]]) -> None:
        spans = [[rank_span(n, j, world_size) for j in range(world_size)] for n in numels]
        self.own = [sp[rank] for sp in spans]
        self.rank, self.world_size = rank, world_size
        self.peers = [j for j in range(world_size) if j != rank]
        sizes = [hi - lo for lo, hi in self.own]
        packed = [g for g in groups if len(g) > 1]
        alone = [g[0] for g in groups if len(g) == 1]
        # per packed group: (its params, their shard sizes s_i, S, peer -> scratch offset of the
        # row it sends this rank, the peers this rank sends a row). A row of padding alone (a rank
        # with no element of any of the group's params) does not travel, as no span of none did.
        self.rows: list[tuple[tuple[int, ...], list[int], int, dict[int, int], list[int]]] = []
        for g in packed:
            s_sizes = [shard_numel(numels[i], world_size) for i in g]
            to = [j for j in self.peers if any(spans[i][j][1] > spans[i][j][0] for i in g)]
            self.rows.append((tuple(g), s_sizes, sum(s_sizes), {}, to))
        self.rest = [i for i in range(len(numels)) if not any(i in g for g in packed)]  # cut from the grads
        # per peer: (scratch offset, elements, param) of each param alone it sends this rank's
        # partition of, and (param, lo, hi) of each param alone this rank sends it a span of
        self.receives: dict[int, list[tuple[int, int, int]]] = {j: [] for j in self.peers}
        self.sends: dict[int, list[tuple[int, int, int]]] = {j: [] for j in self.peers}
        off = 0
        for j in self.peers:
            for g, _, S, at, _ in self.rows:
                if any(sizes[i] for i in g):
                    at[j] = off
                    off += S
            for i in alone:
                if sizes[i]:
                    self.receives[j].append((off, sizes[i], i))
                    off += sizes[i]
                lo, hi = spans[i][j]
                if hi - lo:
                    self.sends[j].append((i, lo, hi))
        self.scratch_numel = off  # the peers' partitions (scratch_numel below) and the rows' padding
        self.some = [i for i in alone if sizes[i]]
        self.pads = [shard_numel(n, world_size) - k for n, k in zip(numels, sizes)]

    def run(self, grads: Sequence[torch.Tensor], scratch: torch.Tensor, comm: Transport, *, tag: int,
            take: Take) -> tuple[P2PWork, Callable[[], list[torch.Tensor]]]:
        W, rank = self.world_size, self.rank
        own = {i: grads[i][self.own[i][0]:self.own[i][1]] for i in self.rest}
        works, ends, keep = [], [], []
        rows = []  # per packed group: its (W, S) staging buffer
        for g, _, S, _, _ in self.rows:
            buf = take(W * S, grads[0].dtype).view(W, S)
            torch._chunk_cat([grads[i] for i in g], dim=0, num_chunks=W, out=buf)  # flat already
            keep.append(buf)
            rows.append(buf)
        got: list[dict[int, torch.Tensor]] = []  # per peer, per param alone with elements: its scratch slice
        sends = 0
        for j in self.peers:  # per peer: the packed rows, then the params alone, on both ends
            for (_, _, S, at, to), buf in zip(self.rows, rows):
                if j in at:
                    works.append(comm.irecv(scratch[at[j]:at[j] + S], j, tag))
                    ends.append(j)
                if j in to:
                    works.append(comm.isend(buf[j], j, tag))
                    ends.append(j)
                    sends += 1
            mine = {}
            for off, n, i in self.receives[j]:
                mine[i] = scratch[off:off + n]
                works.append(comm.irecv(mine[i], j, tag))
                ends.append(j)
            got.append(mine)
            for i, lo, hi in self.sends[j]:
                works.append(comm.isend(grads[i][lo:hi], j, tag))
                ends.append(j)
            sends += len(self.sends[j])
        some, pads, n = self.some, self.pads, len(grads)

        def result() -> list[torch.Tensor]:
            out: list = [None] * n
            for (g, s_sizes, S, at, _), buf in zip(self.rows, rows):
                row = buf[rank]
                for j, o in at.items():  # peer after peer, in rank order
                    row.add_(scratch[o:o + S])
                for i, part in zip(g, row.split(s_sizes)):
                    out[i] = part
            for mine in got if some else ():  # peer after peer, in rank order
                torch._foreach_add_([own[i] for i in some], [mine[i] for i in some])
            for i, o in own.items():
                out[i] = F.pad(o, (0, pads[i])) if pads[i] else o  # pad: a copy
            return out
        return P2PWork(works, ends, None, keep, sends), result


def reduce_scatter(grads: Sequence[torch.Tensor], scratch: torch.Tensor, comm: Transport, *,
                   tag: int, groups: Optional[Sequence[Sequence[int]]] = None,
                   take: Optional[Take] = None,
                   layout: Optional[ReduceLayout] = None) -> tuple[P2PWork, Callable[[], list[torch.Tensor]]]:
    """SUM over ranks of this rank's partition of each flat grad (n_i,). `scratch` holds the
    peers' partitions: the layout's scratch_numel elements (scratch_numel(...) with every param
    alone), one block per peer per group of `groups` (fz3.interpreters.messages), each received
    by one message; a packed group is staged into one (W, S) buffer, a row per peer ([Note:
    packed groups in rows]). -> (work, result): after the work is waited, result() adds them
    into this rank's partitions (a param alone: its grad's own span, written in place; a packed
    group: its row) and returns the partitions, zero-padded to s_i. `layout`: made before for
    grads of these sizes and these groups."""
    groups, take = _defaults(groups, take, len(grads))
    if layout is None:
        layout = ReduceLayout([g.numel() for g in grads], comm.rank, comm.world_size, groups)
    return layout.run(grads, scratch, comm, tag=tag, take=take)


def scratch_numel(numels: Sequence[int], rank: int, world_size: int) -> int:
    """Elements `reduce_scatter` receives with every param alone: this rank's partition of each
    param, per peer (a packed group's row adds its padding: ReduceLayout.scratch_numel)."""
    mine = sum(hi - lo for lo, hi in (rank_span(n, rank, world_size) for n in numels))
    return (world_size - 1) * mine
