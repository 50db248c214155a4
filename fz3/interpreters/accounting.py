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
                 element_size: int, prefetch: bool) -> None:
    """One AllGather of params whose shards total `shard_numel` elements on each rank."""
    counts[f"all_gather_via_{carrier}"] += 1
    counts["all_gather"] += 1
    counts["all_gather_prefetch" if prefetch else "all_gather_on_demand"] += 1
    counts["gathered_bytes"] += shard_numel * world_size * element_size


def reduce_path(e: ReduceBucket, reduce_scatter_by: str) -> str:
    """What runs `e`: "all_reduce" (its path, or a reduce-scatter carried as one), "p2p" or
    "reduce_scatter" (the backend's own)."""
    if e.path == "allreduce" or reduce_scatter_by == "all_reduce":
        return "all_reduce"
    return "p2p" if reduce_scatter_by == "p2p" else "reduce_scatter"


def count_reduce(counts: Counter, e: ReduceBucket, *, path: str, spec: ModelSpec,
                 element_size: int) -> None:
    """One ReduceBucket run as `path` (reduce_path), its grads `element_size` bytes each."""
    if path == "all_reduce":
        # contiguous: the bucket up to its last slot; else the grads packed back to back
        numel = max(s.offset + s.numel for s in e.slots) if e.contiguous else sum(s.numel for s in e.slots)
    else:
        numel = spec.world_size * sum(spec.params[s.param].shard_numel for s in e.slots)
    counts["reduce"] += 1
    counts[f"reduce_{path}"] += 1
    counts["reduced_bytes"] += numel * element_size


def count_across(counts: Counter, *, numel: int, element_size: int, replicas: int) -> None:
    """One all-reduce of a bucket's partitions, `numel` elements, across `replicas` groups
    (hybrid sharding: ReduceBucket.across): reduce_across, across_bytes (the tensor reduced)."""
    counts["reduce_across"] += 1
    counts["across_bytes"] += numel * element_size


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
