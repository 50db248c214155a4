"""Offloading the optimizer: which sub-groups live on a slower tier, and the order of the reads,
steps and writes that step them, as pure decisions over the layout (DeepSpeed's ZeRO-Offload and
ZeRO-Infinity: runtime/zero/stage3.py `_create_fp16_sub_groups`, `subgroup_to_device`, `step`'s
loop of `_optimizer_states_and_gradient_swap_in` / `_optimizer_step` / `..._swap_out`).

    sub_groups(runs, sub_group_size=, ratio=)   the optimizer's sub-groups, each offloaded or not
    schedule(groups, read_ahead=, write_behind=, host=)  the effects of one optimizer step
    budget(read_ahead, write_behind)             offloaded sub-groups in memory at once, at most
    param_reads(queue, start, sizes, pending=, budget=)  the param shards on disk to read ahead
                                                 of the gathers (offload_param "nvme")
    passed_over(pending, at)                     reads whose gather never came, to let go
    queue_index(queue) / queue_position(index, p, pos)   where a gather of p stands in the queue

A sub-group is whole segments of one optimizer param group (fz3/data/store.py: a segment is a
few whole shards whose masters and grads are one tensor each), taken in order until their numel
reaches `sub_group_size` or the param group ends: DeepSpeed's cut, with segments where it takes
params (the step's numbers are the same whatever the cut: the optimizers fz3 steps are
elementwise or per param). An offloaded sub-group's fp32 masters and optimizer state live on the
slower tier between steps; the rest stay where they are. `ratio` offloads the last
ceil-ish share of the sub-groups, as DeepSpeed picks them: sub-group i of n is offloaded when
i >= int((1 - ratio) * n).

One step, sub-group by sub-group in order:

    Read(i)         start bringing i's masters and state into memory
    AwaitRead(i)    i is in memory
    Step(i)         the optimizer steps i's params (and their compute shards are refreshed)
    Write(i)        start writing i back; its memory goes once the write lands
    AwaitWrite(i)   i is back on the slower tier, its memory given back

`host`: the ranks compute on an accelerator and the optimizer steps on the host (ZeRO-Offload:
DeepSpeed's offload_optimizer "cpu", and "nvme" staged through the host). The grad partitions are
reduced on the device and the compute shards are read there; the fp32 masters and the optimizer
state live in host memory (or on disk, for an offloaded sub-group). Around each sub-group's step:

    GradsToHost(i)     start copying i's grad partitions to its host buffers (every sub-group's
                       at the step's start, in order: the copies run while the host steps)
    AwaitGrads(i)      they have landed
    ParamsToDevice(i)  start copying i's stepped masters into its compute shards on the device
    AwaitParams(i)     that copy has landed: before i's host memory may go to disk (AwaitWrite)
                       and before the step returns

`read_ahead` (DeepSpeed's pipeline_read) reads the next offloaded sub-group while one steps;
`write_behind` (pipeline_write) writes one back while the next steps. Each holds one more
sub-group in memory (`budget`), which is why DeepSpeed leaves both off by default, and so does
fz3. The machine fz3/testing/offload_machine.py runs drawn layouts through `schedule` against a
model of the tiers: every sub-group is in one tier at a time, nothing steps before its read has
landed or is written while it steps, the offloaded sub-groups in memory never exceed `budget`,
each sub-group steps once and every offloaded one ends on the slower tier, and the stepped values
equal a step without offload; with `host`, nothing steps on grads that have not landed on the
host, every stepped sub-group reaches the device before the step returns, and no host memory goes
to disk while a copy to the device still reads it.

Params on NVMe: a gather sends each param's shard, which lives on disk with its sub-group. The
queue says what the gathers want next: the order in which the last window's gathers took shards
from disk (between two optimizer steps; the fetches follow the recorded trace, fz3/core/param/
trace.py, so a steady window repeats it, whatever reuse and max_live_parameters kept). Each time a gather takes a param's shard, `queue_position` finds where in
the queue that gather stands (p's next occurrence from the last one taken; from the queue's start
when a new pass begins), and `param_reads` picks the shards to start reading after it, in order,
while the shards read or being read stay within `budget` elements (prefetch_bucket_size), so a
gather finds its shards read ahead instead of waiting on the disk. A read whose gather never came
(the param stayed gathered: reuse, persistence) is let go once a gather past it takes a shard
(`passed_over`). The machine fz3/testing/offload_machine.py
(`gather_pass`) runs drawn passes against it, some gathers skipped: the budget holds, no shard
is read twice at once, no read outlives its gather, and with a budget of two units every gather
after a pass's first finds its shards read.
"""
from __future__ import annotations

import bisect
from typing import AbstractSet, Mapping, NamedTuple, Sequence


class SubGroup(NamedTuple):
    run: int  # the optimizer param group it belongs to
    segments: tuple[int, ...]  # store segment indices, in order
    numel: int
    offloaded: bool


class Read(NamedTuple):
    group: int


class AwaitRead(NamedTuple):
    group: int


class Step(NamedTuple):
    group: int


class Write(NamedTuple):
    group: int


class AwaitWrite(NamedTuple):
    group: int


class GradsToHost(NamedTuple):
    group: int


class AwaitGrads(NamedTuple):
    group: int


class ParamsToDevice(NamedTuple):
    group: int


class AwaitParams(NamedTuple):
    group: int


OffloadEffect = Read | AwaitRead | Step | Write | AwaitWrite | GradsToHost | AwaitGrads | ParamsToDevice | AwaitParams


def sub_groups(runs: Sequence[Sequence[tuple[int, int]]], *, sub_group_size: int,
               ratio: float = 1.0, offload: bool = True) -> tuple[SubGroup, ...]:
    """`runs`: per optimizer param group, its segments as (segment index, numel), in order. A
    sub-group takes segments until its numel reaches `sub_group_size` or the run ends
    (DeepSpeed's `_create_fp16_sub_groups`: `local_sub_group_size >= sub_group_size`); the last
    share `ratio` of them is offloaded (`subgroup_to_device`), none when not `offload`."""
    cut: list[tuple[int, tuple[int, ...], int]] = []
    for r, run in enumerate(runs):
        segs: list[int] = []
        total = 0
        for seg, numel in run:
            segs.append(seg)
            total += numel
            if total >= sub_group_size:
                cut.append((r, tuple(segs), total))
                segs, total = [], 0
        if segs:
            cut.append((r, tuple(segs), total))
    first = int((1 - ratio) * len(cut))  # DeepSpeed: i >= int((1 - partial_offload) * n) goes to the CPU
    return tuple(SubGroup(run=r, segments=segs, numel=n, offloaded=offload and i >= first)
                 for i, (r, segs, n) in enumerate(cut))


def budget(read_ahead: bool, write_behind: bool) -> int:
    """Offloaded sub-groups in memory at once, at most: the one stepping, the one read ahead,
    the one still being written."""
    return 1 + int(read_ahead) + int(write_behind)


def param_reads(queue: Sequence[int], start: int, sizes: Mapping[int, int], *, pending: Mapping[int, int],
                budget: int) -> tuple[tuple[int, int], ...]:
    """The params of `queue[start:]` (ParamIds in fetch order; those in `sizes`, the shards on
    disk, by numel) to start reading now, as (queue index, param), in order: each not in
    `pending` (param -> the index it was read for, not yet taken by its gather) once, while
    `pending`'s elements and theirs stay within `budget`. It stops at the first that does not
    fit, so the reads keep the queue's order: the next gather's shards are never passed over for
    a later one's."""
    used = sum(sizes[p] for p in pending)
    out: list[tuple[int, int]] = []
    taken = set(pending)
    for i in range(start, len(queue)):
        p = queue[i]
        if p in taken or p not in sizes:
            continue
        if used + sizes[p] > budget:
            break
        out.append((i, p))
        taken.add(p)
        used += sizes[p]
    return tuple(out)


def passed_over(pending: Mapping[int, int], at: int) -> tuple[int, ...]:
    """The params read ahead for a gather before queue index `at` that never took them (the
    param stayed gathered, or the pass went another way): let go, so they hold no budget."""
    return tuple(p for p, i in pending.items() if i < at)


def queue_index(queue: Sequence[int]) -> dict[int, tuple[int, ...]]:
    """Each ParamId of `queue` -> its indices there, in order (for `queue_position`)."""
    index: dict[int, list[int]] = {}
    for i, p in enumerate(queue):
        index.setdefault(p, []).append(i)
    return {p: tuple(ix) for p, ix in index.items()}


def queue_position(index: Mapping[int, Sequence[int]], p: int, pos: int) -> int | None:
    """The queue index of the gather taking p now: p's first occurrence at or after `pos` (just
    past the last one taken), else its first (a new pass); None if p is not in the queue (the
    pass departed from the trace: nothing is read ahead)."""
    ix = index.get(p)
    if not ix:
        return None
    k = bisect.bisect_left(ix, pos)
    return ix[k] if k < len(ix) else ix[0]


def schedule(groups: Sequence[SubGroup], *, read_ahead: bool = False, write_behind: bool = False,
             host: bool = False) -> tuple[OffloadEffect, ...]:
    """The effects of one optimizer step over `groups`, in order (see the module docstring)."""
    offloaded = [i for i, g in enumerate(groups) if g.offloaded]
    after = {i: (offloaded[k + 1] if k + 1 < len(offloaded) else None) for k, i in enumerate(offloaded)}
    effects: list[OffloadEffect] = [GradsToHost(group=i) for i in range(len(groups))] if host else []
    read: set[int] = set()
    to_device: list[int] = []  # copies to the device in flight (host)
    writing: int | None = None  # the sub-group whose write is in flight (write_behind)

    def await_write(i: int) -> None:
        if i in to_device:  # its memory goes when the write lands: the copy must be done reading it
            effects.append(AwaitParams(group=i))
            to_device.remove(i)
        effects.append(AwaitWrite(group=i))

    for i, g in enumerate(groups):
        if g.offloaded:
            if i not in read:
                effects.append(Read(group=i))
                read.add(i)
            effects.append(AwaitRead(group=i))
            nxt = after[i]
            if read_ahead and nxt is not None:
                effects.append(Read(group=nxt))
                read.add(nxt)
        if host:
            effects.append(AwaitGrads(group=i))
        effects.append(Step(group=i))
        if host:
            effects.append(ParamsToDevice(group=i))
            to_device.append(i)
        if g.offloaded:
            if writing is not None:
                await_write(writing)
            effects.append(Write(group=i))
            writing = i
            if not write_behind:
                await_write(i)
                writing = None
    if writing is not None:
        await_write(writing)
    effects.extend(AwaitParams(group=i) for i in to_device)
    return tuple(effects)
