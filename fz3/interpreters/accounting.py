"""Which carrier runs each collective, and what one counts: shared by the interpreter that runs
the collectives (dist.py) and the one that only plans them (planned.py), so a plan's counts and
bytes are the real run's by construction.

    carriers(options, backend)  -> (gather_by, reduce_scatter_by): "p2p" | "all_reduce" | "native"
    bucket_capacity(...)         the largest bucket a reduce can get, in elements (fz3.core.grad.
                                 grads.capacity under the reduce-scatter carrier's route and hold
                                 budget, at most the trainable elements)
                                   (gloo: Options.gloo_all_gather / gloo_reduce_scatter; nccl and
                                   hccl: their own collectives)
    count_gather(counts, ...)    all_gather, all_gather_via_<carrier>, _prefetch | _on_demand,
                                 gathered_bytes (W x the shards' bytes: what lands in the full
                                 values, padding included)
    count_reduce(counts, ...)    reduce, reduce_<path>, reduced_bytes (the flat bucket for an
                                 all-reduce; W x the partitions' bytes for a reduce-scatter)
    count_across(counts, ...)    reduce_across, across_bytes: hybrid sharding's all-reduce of a
                                 bucket's partitions across the groups
    count_links(counts, ...)     bytes_ and messages_intra_group, _inter_group: what a rank sends
                                 on each link ([Note: bytes on each link])
    link_local(...)              the ranks of a collective in this rank's link group
    p2p_sends(...)               the messages a point-to-point gather or reduce posts on one rank:
                                 one per peer per message group with elements for it
                                 (fz3/interpreters/p2p.py; counted as p2p_sends)
"""
from __future__ import annotations

from collections import Counter
from typing import Sequence

from fz3.config.config import Config
from fz3.config.options import Options
from fz3.core.grad import grads
from fz3.core.effects import ReduceBucket
from fz3.core.spec import ModelSpec
from fz3.data.layout import rank_span
from fz3.interpreters.carriers import CARRIERS


def carriers(options: Options, backend: str) -> tuple[str, str]:
    """How this backend carries all-gathers and reduce-scatters."""
    if backend == "gloo":
        return options.gloo_all_gather, options.gloo_reduce_scatter
    return "native", "native"


def bucket_capacity(config: Config, reduce_scatter_by: str, store) -> int:
    """Elements the largest bucket can hold: what the reduce buffers are sized by."""
    carrier = CARRIERS[reduce_scatter_by]
    trainable = sum(s.numel for s, t in zip(store.spec.params, store.trainable) if t)
    return max(1, min(grads.capacity(config, in_place_reduce_scatter=carrier.reads_grads_in_place,
                                     hold_budget=carrier.hold_budget), trainable))


def count_gather(counts: Counter, *, carrier: str, shard_numel: int, world_size: int,
                 element_size: int, prefetch: bool, local: int | None = None, secondary: bool = False) -> None:
    """One AllGather of params whose shards total `shard_numel` elements on each rank; `local`:
    of its `world_size` ranks, those in this rank's link group (count_links). `secondary`: of
    hpZ's secondary shards, within its group (all_gather_hpz; [Note: hpZ], fz3/core/stage.py)."""
    counts[f"all_gather_via_{carrier}"] += 1
    counts["all_gather"] += 1
    if secondary:
        counts["all_gather_hpz"] += 1
    counts["all_gather_prefetch" if prefetch else "all_gather_on_demand"] += 1
    counts["gathered_bytes"] += shard_numel * world_size * element_size
    count_links(counts, per_peer=shard_numel * element_size, ranks=world_size, local=local)


def count_links(counts: Counter, *, per_peer: int, ranks: int, local: int | None, messages: int = 1) -> None:
    """[Note: bytes on each link] A collective over `ranks` ranks in which this rank sends
    `per_peer` bytes to each other rank, in `messages` messages, `local` of the ranks (itself
    included) in its link group: bytes_ and messages_intra_group, bytes_ and
    messages_inter_group. The link groups are the shard groups under hybrid
    sharding, else the nodes the launcher reports (LOCAL_WORLD_SIZE; fz3.plan's
    ranks_per_node), else one group of every rank."""
    local = ranks if local is None else local
    counts["bytes_intra_group"] += per_peer * (local - 1)
    counts["bytes_inter_group"] += per_peer * (ranks - local)
    counts["messages_intra_group"] += (local - 1) * messages
    counts["messages_inter_group"] += (ranks - local) * messages


# [Note: bytes on each link] What a rank sends per collective, as fz3's point-to-point carriers
# send it (a direct exchange: every rank to every other): an all-gather, its shard to each peer;
# a reduce-scatter, each peer's partition of the bucket; an all-reduce (the all-reduce path, and
# hybrid sharding's reduce across the groups), a reduce-scatter then an all-gather of it, 2 N / W
# to each peer (a ring moves as much). Bytes sent, per rank: what each link's bandwidth carries.
# Messages: one per peer per collective, two for an all-reduce (its two halves): what each
# link's latency is paid for (the p2p carrier may split one into several: p2p_sends counts those).
# Within a group of S on one node and across R groups, each grad element crosses the inter-group
# link once per reduce (2 (R - 1) / R of the partitions), and no gather crosses it at all. hpZ
# (flat, groups of H within a node) keeps the backward's gathers on the node: the forward's
# gathers and the reduces cross as in flat ZeRO-3.


def reduce_path(e: ReduceBucket, reduce_scatter_by: str) -> str:
    """What runs `e`: "all_reduce" (its path, or a reduce-scatter carried as one), "p2p" or
    "reduce_scatter" (the backend's own)."""
    if e.path == "allreduce" or reduce_scatter_by == "all_reduce":
        return "all_reduce"
    return "p2p" if reduce_scatter_by == "p2p" else "reduce_scatter"


def count_reduce(counts: Counter, e: ReduceBucket, *, path: str, spec: ModelSpec,
                 element_size: int, local: int | None = None) -> None:
    """One ReduceBucket run as `path` (reduce_path), its grads `element_size` bytes each, within
    the layout's ranks (`local` of them in this rank's link group: count_links)."""
    W = spec.world_size
    ranks = W if W > 1 else spec.ranks  # a layout of one rank (stage 0) all-reduces over every rank
    if path == "all_reduce":
        # contiguous: the bucket up to its last slot; else the grads packed back to back
        numel = max(s.offset + s.numel for s in e.slots) if e.contiguous else sum(s.numel for s in e.slots)
        per_peer = 2 * numel * element_size // ranks
    else:
        numel = W * sum(spec.params[s.param].shard_numel for s in e.slots)
        per_peer = numel * element_size // W
    counts["reduce"] += 1
    counts[f"reduce_{path}"] += 1
    counts["reduced_bytes"] += numel * element_size
    count_links(counts, per_peer=per_peer, ranks=ranks, local=local, messages=2 if path == "all_reduce" else 1)


def count_across(counts: Counter, *, numel: int, element_size: int, replicas: int) -> None:
    """One all-reduce of a bucket's partitions, `numel` elements, across `replicas` groups
    (hybrid sharding: ReduceBucket.across): reduce_across, across_bytes (the tensor reduced)."""
    counts["reduce_across"] += 1
    counts["across_bytes"] += numel * element_size
    count_links(counts, per_peer=2 * numel * element_size // replicas, ranks=replicas, local=1,  # one per group
                messages=2)


def p2p_sends(numels: Sequence[int], groups: Sequence[Sequence[int]], rank: int, world_size: int, *,
              gather: bool) -> int:
    """Sends `rank` posts for one point-to-point collective over params of `numels` in message
    `groups`: a gather sends each group's own elements to every peer, a reduce each peer's
    elements to it; a message with no elements is not sent."""
    def has(g, r):
        return any(hi > lo for lo, hi in (rank_span(numels[i], r, world_size) for i in g))
    peers = [j for j in range(world_size) if j != rank]
    if gather:
        return sum(len(peers) for g in groups if has(g, rank))
    return sum(has(g, j) for g in groups for j in peers)


def secondary_local(spec: ModelSpec, ranks_per_node: int | None, rank: int) -> int | None:
    """Of hpZ's group (H consecutive ranks, within the shard group: [Note: hpZ]), the ranks in
    `rank`'s link group: all of them under hybrid sharding or on one node (None); else those on
    its node."""
    local = link_local(spec, ranks_per_node)
    if local is None:
        return None
    H = spec.secondary
    first = rank - rank % H
    return sum((first + j) // local == rank // local for j in range(H))


def link_local(spec: ModelSpec, ranks_per_node: int | None) -> int | None:
    """Of the ranks a gather or an in-group reduce spans, those in this rank's link group
    ([Note: bytes on each link]): the whole shard group under hybrid sharding (None: all); else
    the rank's node (flat ZeRO-3 over nodes of `ranks_per_node`, which divides the world)."""
    return None if spec.groups > 1 else ranks_per_node
