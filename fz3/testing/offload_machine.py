"""Optimizer offload as a Hypothesis state machine: fz3/core/offload.py's sub-groups and step
schedule, run against a model of the tiers.

    initialize   a layout: optimizer param groups of segments (numels 1-9), sub_group_size,
                 ratio, whether the schedule reads ahead and writes behind, and whether the
                 optimizer steps on the host for an accelerator's ranks (`host`: then the grads
                 and the compute shards are on the device, a third tier)
    rules        step(): one optimizer step's schedule, executed on the model; pipeline(): new
                 read_ahead / write_behind, as a config change between runs; gather_pass(): the
                 segments as params on disk, gathered unit by unit in a drawn forward and its
                 backward, each shard taken from what `param_reads` read ahead or, missing, read
                 then
    checks       every sub-group is in one tier at a time: on disk, being read, in memory or
                 being written (a Read only from disk, an AwaitRead only of a read, a Write only
                 of what is in memory, an AwaitWrite only of a write); nothing steps before its
                 read has landed, nor while it is written; the offloaded sub-groups in memory
                 never exceed `budget`; every sub-group steps once a step and every offloaded
                 one ends on disk; the values equal a step without offload; the cut and the
                 offloaded share are DeepSpeed's (NaiveCut, transcribed); with `host`, nothing
                 steps before its grads have landed on the host, each sub-group's grads are
                 copied once, every stepped sub-group's values reach the device before the step
                 returns, and a copy to the device never reads host memory gone to disk; in a
                 pass, the shards read ahead stay within the budget, none is read twice at once
                 or from before the gather taking it, `queue_position` finds each gather, and
                 with a budget of two units only a pass's first shard waits on the disk

The values: each segment holds an integer, a step maps v -> 3v + g in memory (exact; g the step's
grad, 1 on the host ranks' own memory, the step's number once copied from a device), a Write
copies memory to the disk when it is issued (a write in flight reads the buffer: nothing may
change it until AwaitWrite), a Read copies the disk to memory when it lands, and a copy to the
device reads the host memory when it lands.
Reuse: `TestOffload = OffloadMachine.TestCase`.
"""
from __future__ import annotations

import fz3.testing.extra  # noqa: F401 - Hypothesis, or an ImportError naming the test extra
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from fz3.core import offload
from fz3.core.offload import (AwaitGrads, AwaitParams, AwaitRead, AwaitWrite, GradsToHost, ParamsToDevice, Read,
                              Step, Write)
from fz3.testing.coverage import covered

DISK, READING, MEMORY, WRITING = "disk", "reading", "memory", "writing"


def naive_cut(runs, sub_group_size: int, ratio: float) -> list[tuple[tuple[int, ...], bool]]:
    """DeepSpeed 0.19.8's `_create_fp16_sub_groups` and `subgroup_to_device` (stage3.py),
    transcribed over segments: append, close when the size reaches sub_group_size or the
    group's last element is taken; sub-group i is on the CPU when i >= int((1 - ratio) * n)."""
    sub_groups = []
    for run in runs:
        numel = sum(n for _, n in run)
        if sub_group_size >= numel:
            if run:
                sub_groups.append([s for s, _ in run])
            continue
        group, size = [], 0
        for k, (seg, n) in enumerate(run):
            group.append(seg)
            size += n
            if size >= sub_group_size or k == len(run) - 1:
                sub_groups.append(group)
                group, size = [], 0
    n = len(sub_groups)
    return [(tuple(g), i >= int((1 - ratio) * n)) for i, g in enumerate(sub_groups)]


class OffloadMachine(RuleBasedStateMachine):
    @initialize(runs=st.lists(st.lists(st.integers(1, 9), min_size=0, max_size=5), min_size=1, max_size=3),
                sub_group_size=st.integers(1, 20), ratio=st.sampled_from([1.0, 1.0, 0.0, 0.25, 0.5, 0.75]),
                read_ahead=st.booleans(), write_behind=st.booleans(), host=st.booleans())
    def setup(self, runs, sub_group_size: int, ratio: float, read_ahead: bool, write_behind: bool,
              host: bool) -> None:
        seg = iter(range(100))
        self.runs = [[(next(seg), n) for n in run] for run in runs]
        self.groups = offload.sub_groups(self.runs, sub_group_size=sub_group_size, ratio=ratio)
        note(f"runs {self.runs}, sub_group_size {sub_group_size}, ratio {ratio}: {self.groups}")
        naive = naive_cut(self.runs, sub_group_size, ratio)
        got = [(g.segments, g.offloaded) for g in self.groups]
        assert got == naive, f"sub-groups {got} != DeepSpeed's cut {naive}"
        numel = {s: n for run in self.runs for s, n in run}
        assert all(g.numel == sum(numel[s] for s in g.segments) for g in self.groups), self.groups
        self.read_ahead, self.write_behind = read_ahead, write_behind
        self.tier = [DISK if g.offloaded else MEMORY for g in self.groups]
        start = {s: s + 1 for run in self.runs for s, _ in run}
        self.memory = {i: ({s: start[s] for s in g.segments} if not g.offloaded else None)
                       for i, g in enumerate(self.groups)}
        self.disk = {i: {s: start[s] for s in g.segments} for i, g in enumerate(self.groups) if g.offloaded}
        self.expected = dict(start)  # the same steps without offload
        self.host, self.steps = host, 0
        self.device = dict(start) if host else None  # the compute shards' values, on the device
        covered("examples", "optimizer offload")
        if host:
            covered("offload", "the optimizer steps on the host (accelerator ranks)")
        if any(g.offloaded for g in self.groups) and not all(g.offloaded for g in self.groups):
            covered("offload", "part of the sub-groups offloaded (ratio)")

    @precondition(lambda self: hasattr(self, "groups"))
    @rule(read_ahead=st.booleans(), write_behind=st.booleans())
    def pipeline(self, read_ahead: bool, write_behind: bool) -> None:
        self.read_ahead, self.write_behind = read_ahead, write_behind

    @precondition(lambda self: hasattr(self, "groups"))
    @rule()
    def step(self) -> None:
        effects = offload.schedule(self.groups, read_ahead=self.read_ahead, write_behind=self.write_behind,
                                   host=self.host)
        note(f"step (read_ahead {self.read_ahead}, write_behind {self.write_behind}, host {self.host}): {effects}")
        limit = offload.budget(self.read_ahead, self.write_behind)
        self.steps += 1
        grad = self.steps + 1 if self.host else 1  # this step's grad, on the device when `host`
        stepped: list[int] = []
        written: dict[int, dict[int, int]] = {}  # what a write in flight carries
        grads: dict[int, str] = {}  # host: each sub-group's grads, "copying" then "host"
        to_device: set[int] = set()  # host: copies of stepped values to the device in flight
        peak = 0
        for e in effects:
            i = e.group
            g = self.groups[i]
            match e:
                case Read():
                    assert g.offloaded and self.tier[i] == DISK, f"{e}: sub-group {i} is {self.tier[i]}, not on disk"
                    self.tier[i] = READING
                case AwaitRead():
                    assert self.tier[i] == READING, f"{e}: sub-group {i} is {self.tier[i]}, no read in flight"
                    self.tier[i], self.memory[i] = MEMORY, dict(self.disk[i])
                case GradsToHost():
                    assert self.host and i not in grads, f"{e}: sub-group {i}'s grads copied twice, or without a device"
                    grads[i] = "copying"
                case AwaitGrads():
                    assert grads.get(i) == "copying", f"{e}: no copy of sub-group {i}'s grads in flight"
                    grads[i] = "host"
                case Step():
                    assert self.tier[i] == MEMORY, f"{e}: sub-group {i} steps while {self.tier[i]}"
                    assert i not in stepped, f"{e}: sub-group {i} steps twice in one step"
                    assert not self.host or grads.get(i) == "host", (
                        f"{e}: sub-group {i} steps on grads that have not landed on the host ({grads.get(i)})")
                    stepped.append(i)
                    self.memory[i] = {s: 3 * v + grad for s, v in self.memory[i].items()}
                case ParamsToDevice():
                    assert self.host and i in stepped and i not in to_device, (
                        f"{e}: sub-group {i} copied to the device before its step, twice, or without a device")
                    to_device.add(i)
                case AwaitParams():
                    assert i in to_device, f"{e}: no copy of sub-group {i} to the device in flight"
                    assert self.memory[i] is not None, (
                        f"{e}: the copy to the device reads sub-group {i}'s host memory, gone to disk")
                    to_device.discard(i)
                    self.device.update(self.memory[i])
                case Write():
                    assert g.offloaded and self.tier[i] == MEMORY and i in stepped, (
                        f"{e}: sub-group {i} is {self.tier[i]}{'' if i in stepped else ', not stepped yet'}")
                    self.tier[i], written[i] = WRITING, dict(self.memory[i])
                case AwaitWrite():
                    assert self.tier[i] == WRITING, f"{e}: sub-group {i} is {self.tier[i]}, no write in flight"
                    self.tier[i], self.disk[i], self.memory[i] = DISK, written.pop(i), None
            held = sum(1 for j, t in enumerate(self.tier) if self.groups[j].offloaded and t != DISK)
            peak = max(peak, held)
            assert held <= limit, f"after {e}: {held} offloaded sub-groups in memory, over the budget {limit}"
        assert sorted(stepped) == list(range(len(self.groups))), f"stepped {stepped} of {len(self.groups)} sub-groups"
        assert not to_device, f"the step returns with copies to the device in flight: sub-groups {sorted(to_device)}"
        for s in self.expected:
            self.expected[s] = 3 * self.expected[s] + grad
        if peak > 1:
            covered("offload", f"{peak} offloaded sub-groups in memory at once (pipelined)")
        elif peak == 1:
            covered("offload", "one sub-group at a time")

    @precondition(lambda self: hasattr(self, "groups") and any(self.runs))
    @rule(data=st.data())
    def gather_pass(self, data) -> None:
        sizes = {s: n for run in self.runs for s, n in run}
        order = data.draw(st.permutations(sorted(sizes)), label="fetch order")
        cuts = sorted(set(data.draw(st.lists(st.integers(1, len(order) - 1), max_size=4), label="unit cuts"))
                      ) if len(order) > 1 else []
        units = [order[a:b] for a, b in zip([0] + cuts, cuts + [len(order)])]
        passes = units + units[::-1]  # the forward, then the backward in reverse
        queue = [p for u in passes for p in u]
        widest = max(sum(sizes[p] for p in u) for u in units)
        budget = data.draw(st.integers(0, 3 * widest), label="budget")
        # gathers that do not come (the param stayed gathered): never the pass's first
        skipped = data.draw(st.sets(st.integers(1, len(queue) - 1), max_size=3), label="skipped") if len(queue) > 1 \
            else set()
        index = offload.queue_index(queue)
        pending: dict[int, int] = {}  # param -> the queue index it was read for
        waited, pos = [], 0
        for at, p in enumerate(queue):
            if at in skipped:
                continue
            here = offload.queue_position(index, p, pos)
            if not any(i < at for i in skipped):
                assert here == at, f"queue_position({p}, {pos}) = {here}, the gather is at {at}"
            else:  # past a skipped gather the place is a guess: p's next occurrence, not past this one
                assert here is not None and pos <= here <= at and queue[here] == p, (
                    f"queue_position({p}, {pos}) = {here}, the gather is at {at}")
            for q in offload.passed_over(pending, here):
                assert pending[q] < here, f"{q}'s read for {pending[q]} let go at {here}"
                del pending[q]
            assert all(i >= here for i in pending.values()), f"at {here}: reads for gathers past, still held: {pending}"
            if p in pending:
                i = pending.pop(p)
                assert i == here, f"{p} was read for the gather at {i}, taken by the one at {here}"
            else:
                waited.append(at)
            reads = offload.param_reads(queue, here + 1, sizes, pending=dict(pending), budget=budget)
            got = [q for _, q in reads]
            assert not set(got) & set(pending) and len(set(got)) == len(got), f"{reads}: read twice at once"
            assert all(i > here and queue[i] == q for i, q in reads), f"{reads}: not gathered after position {here}"
            pending.update((q, i) for i, q in reads)
            held = sum(sizes[q] for q in pending)
            assert held <= budget, f"after {p}'s gather: {held} elements read ahead, over the budget {budget}"
            pos = here + 1
        note(f"pass {passes}, sizes {sizes}, budget {budget}, skipped {sorted(skipped)}: waited at {waited}")
        if budget >= 2 * widest and not skipped:
            assert waited == [0], f"with a budget of two units ({budget}) the gathers at {waited} waited on the disk"
            covered("offload", "params read ahead of every gather but a pass's first")
        elif len(waited) < len(queue) - len(skipped):
            covered("offload", "params read ahead within a tight budget" + (", gathers skipped" if skipped else ""))

    @invariant()
    def tiers_and_values(self) -> None:
        if not hasattr(self, "groups"):
            return
        for i, g in enumerate(self.groups):
            if g.offloaded:
                assert self.tier[i] == DISK, f"after a step sub-group {i} is {self.tier[i]}, not back on disk"
                assert self.memory[i] is None, f"sub-group {i} is on disk and still holds memory"
                values = self.disk[i]
            else:
                assert self.tier[i] == MEMORY, f"sub-group {i} is not offloaded and moved to {self.tier[i]}"
                values = self.memory[i]
            for s, v in values.items():
                assert v == self.expected[s], f"segment {s}: {v} after the steps, without offload {self.expected[s]}"
                if self.host:
                    assert self.device[s] == v, f"segment {s}: {self.device[s]} on the device, {v} on the host"
        covered("offload", "values equal a step without offload")
