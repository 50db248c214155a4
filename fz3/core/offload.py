"""Offloading the optimizer: which sub-groups live on a slower tier, and the order of the reads,
steps and writes that step them, as pure decisions over the layout (DeepSpeed's ZeRO-Offload and
ZeRO-Infinity: runtime/zero/stage3.py `_create_fp16_sub_groups`, `subgroup_to_device`, `step`'s
loop of `_optimizer_states_and_gradient_swap_in` / `_optimizer_step` / `..._swap_out`).

    sub_groups(runs, sub_group_size=, ratio=)   the optimizer's sub-groups, each offloaded or not
    schedule(groups, read_ahead=, write_behind=)  the effects of one optimizer step
    budget(read_ahead, write_behind)             offloaded sub-groups in memory at once, at most

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

`read_ahead` (DeepSpeed's pipeline_read) reads the next offloaded sub-group while one steps;
`write_behind` (pipeline_write) writes one back while the next steps. Each holds one more
sub-group in memory (`budget`), which is why DeepSpeed leaves both off by default, and so does
fz3. The machine fz3/testing/offload_machine.py runs drawn layouts through `schedule` against a
model of the tiers: every sub-group is in one tier at a time, nothing steps before its read has
landed or is written while it steps, the offloaded sub-groups in memory never exceed `budget`,
each sub-group steps once and every offloaded one ends on the slower tier, and the stepped values
equal a step without offload.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence


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


OffloadEffect = Read | AwaitRead | Step | Write | AwaitWrite


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


def schedule(groups: Sequence[SubGroup], *, read_ahead: bool = False,
             write_behind: bool = False) -> tuple[OffloadEffect, ...]:
    """The effects of one optimizer step over `groups`, in order (see the module docstring)."""
    offloaded = [i for i, g in enumerate(groups) if g.offloaded]
    after = {i: (offloaded[k + 1] if k + 1 < len(offloaded) else None) for k, i in enumerate(offloaded)}
    effects: list[OffloadEffect] = []
    read: set[int] = set()
    writing: int | None = None  # the sub-group whose write is in flight (write_behind)
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
        effects.append(Step(group=i))
        if g.offloaded:
            if writing is not None:
                effects.append(AwaitWrite(group=writing))
            effects.append(Write(group=i))
            writing = i
            if not write_behind:
                effects.append(AwaitWrite(group=i))
                writing = None
    if writing is not None:
        effects.append(AwaitWrite(group=writing))
    return tuple(effects)
