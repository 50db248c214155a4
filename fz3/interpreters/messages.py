"""Which params of one collective travel together: one message per peer per group.

    groups(numels, small=..., most=...)   -> the params' positions, as message groups

A collective effect (AllGather, ReduceBucket) is already over a group of params. How many
messages it costs is the carrier's count of sends: the backend's own collectives (NCCL, HCCL,
gloo's) pack the whole effect into one flat buffer, while the point-to-point carrier sends each
param's slice straight from where it lies, with no staging copy. For a large param that is the
point; for a small one the message costs more than its bytes: issue #27's timers put ~395 sends
and ~395 receives a step at ~23 ms of the deep narrow benchmark GPT's 61 ms, about 30 us each,
far more than copying a few KiB.

So the small params of an effect are packed: every param of at most `small` elements joins the
current group until the group would pass `most` elements, then a new group starts; a larger
param is a group of its own (sent from where it lies). Positions keep the effect's order inside
each group, packed groups first, then the large params in order. Every rank computes the same
groups from the same numels (SPMD), so both ends of a message agree on its layout without a
word. A param of no elements is in no group: nothing travels for it.

`small=0` packs nothing: one message per param per peer, as before issue #27.
"""
from __future__ import annotations

from typing import Sequence

GROUP_MOST = 1 << 20
"""A packed group's elements at most (4 MiB of fp32): the staging copy a group costs is at most
this, on top of what the live budget holds, while a send of that size costs its bytes, not its
latency."""


def groups(numels: Sequence[int], *, small: int, most: int = GROUP_MOST) -> tuple[tuple[int, ...], ...]:
    """Positions of `numels` as message groups: packed groups of the params of at most `small`
    elements (each group at most `most` elements, or one param when a single one is more), then
    each larger param alone. Empty params are left out."""
    packed: list[list[int]] = []
    alone: list[tuple[int, ...]] = []
    total = 0
    for i, n in enumerate(numels):
        if n <= 0:
            continue
        if n > small:
            alone.append((i,))
            continue
        if not packed or total + n > most:
            packed.append([])
            total = 0
        packed[-1].append(i)
        total += n
    return tuple(tuple(g) for g in packed) + tuple(alone)
