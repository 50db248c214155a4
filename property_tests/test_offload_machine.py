"""Optimizer offload's decisions (fz3/testing/offload_machine.py) under the active profile, and its
teeth: each planted bug in fz3/core/offload.py is caught by the machine (fixed settings,
derandomized)."""
import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from fz3.core import offload
from fz3.core.offload import AwaitGrads, AwaitParams, AwaitRead, AwaitWrite, ParamsToDevice, Read, SubGroup
from fz3.testing.offload_machine import OffloadMachine
from fz3.testing.patch import patched

TestOffload = OffloadMachine.TestCase

STRICT = settings(max_examples=300, deadline=None, database=None, derandomize=True,
                  phases=[Phase.explicit, Phase.generate], report_multiple_bugs=False)
_schedule, _cut = offload.schedule, offload.sub_groups


def stepping_before_the_read_lands(groups, **flags):
    """Planted: the step does not wait for its sub-group's read."""
    return tuple(e for e in _schedule(groups, **flags) if not isinstance(e, AwaitRead))


def reading_two_ahead(groups, *, read_ahead=False, write_behind=False, host=False):
    """Planted: reading ahead reads every offloaded sub-group at once, past the budget."""
    effects = _schedule(groups, read_ahead=read_ahead, write_behind=write_behind, host=host)
    if not read_ahead:
        return effects
    reads = [e for e in effects if isinstance(e, Read)]
    rest = [e for e in effects if not isinstance(e, Read)]
    return tuple(reads + rest)


def last_write_not_awaited(groups, **flags):
    """Planted: the step returns with the last write still in flight."""
    effects = _schedule(groups, **flags)
    return effects[:-1] if effects and isinstance(effects[-1], AwaitWrite) else effects


def stepping_before_the_grads_land(groups, **flags):
    """Planted: the host steps without waiting for its sub-group's grads from the device."""
    return tuple(e for e in _schedule(groups, **flags) if not isinstance(e, AwaitGrads))


def last_params_not_sent(groups, **flags):
    """Planted: the last sub-group's stepped values never go back to the device."""
    effects = list(_schedule(groups, **flags))
    sent = [k for k, e in enumerate(effects) if isinstance(e, ParamsToDevice)]
    if sent:
        last = effects[sent[-1]].group
        effects = [e for e in effects if not (isinstance(e, (ParamsToDevice, AwaitParams)) and e.group == last)]
    return tuple(effects)


def freed_while_copied_to_the_device(groups, **flags):
    """Planted: a sub-group's host memory goes to disk before its copy to the device has landed."""
    effects = list(_schedule(groups, **flags))
    out = []
    for e in effects:
        if isinstance(e, AwaitParams) and groups[e.group].offloaded:
            continue
        out.append(e)
        if isinstance(e, AwaitWrite) and any(isinstance(x, ParamsToDevice) and x.group == e.group for x in effects):
            out.append(AwaitParams(group=e.group))
    return tuple(out)


_reads, _position = offload.param_reads, offload.queue_position


def reads_past_the_budget(queue, start, sizes, *, pending, budget):
    """Planted: reading ahead forgets what is already read and not yet taken."""
    return _reads(queue, start, sizes, pending={}, budget=budget)


def reads_one_late(queue, start, sizes, *, pending, budget):
    """Planted: the read-ahead starts one param after the next gather's."""
    return _reads(queue, start + 1, sizes, pending=pending, budget=budget)


def nothing_passed_over(pending, at):
    """Planted: a read whose gather never came is held for good."""
    return ()


def position_from_the_start(index, p, pos):
    """Planted: a gather is placed at p's first occurrence, so the backward's reads start in the forward."""
    return _position(index, p, 0)


def ratio_off_by_one(runs, *, sub_group_size, ratio=1.0, offload=True):
    """Planted: one sub-group fewer offloaded than DeepSpeed's int((1 - ratio) * n) rule."""
    groups = _cut(runs, sub_group_size=sub_group_size, ratio=ratio, offload=offload)
    first = next((i for i, g in enumerate(groups) if g.offloaded), None)
    if first is None or ratio == 1.0:
        return groups
    return tuple(g._replace(offloaded=False) if i == first else g for i, g in enumerate(groups))


def cut_after_the_size(runs, *, sub_group_size, ratio=1.0, offload=True):
    """Planted: a sub-group closes only once it is past sub_group_size, not when it reaches it."""
    return _cut(runs, sub_group_size=sub_group_size + 1, ratio=ratio, offload=offload)


@pytest.mark.parametrize("target, bug, message", [
    ("fz3.core.offload:schedule", stepping_before_the_read_lands, "steps while reading"),
    ("fz3.core.offload:schedule", reading_two_ahead, "over the budget"),
    ("fz3.core.offload:schedule", last_write_not_awaited, "not back on disk"),
    ("fz3.core.offload:schedule", stepping_before_the_grads_land, "not landed on the host"),
    ("fz3.core.offload:schedule", last_params_not_sent, "on the device"),
    ("fz3.core.offload:schedule", freed_while_copied_to_the_device, "gone to disk"),
    ("fz3.core.offload:param_reads", reads_past_the_budget, "read twice at once|over the budget"),
    ("fz3.core.offload:param_reads", reads_one_late, "waited on the disk|read for the gather at"),
    ("fz3.core.offload:queue_position", position_from_the_start, "the gather is at"),
    ("fz3.core.offload:passed_over", nothing_passed_over, "reads for gathers past|read for the gather at"),
    ("fz3.core.offload:sub_groups", ratio_off_by_one, "DeepSpeed's cut"),
    ("fz3.core.offload:sub_groups", cut_after_the_size, "DeepSpeed's cut"),
])
def test_the_machine_catches(target, bug, message):
    with patched(target, bug):
        with pytest.raises(AssertionError, match=message):
            run_state_machine_as_test(OffloadMachine, settings=STRICT)


def test_the_budget_holds_each_pipelining():
    """budget: 1 sub-group in memory without pipelining, 2 with one of read-ahead / write-behind, 3 with both."""
    assert [offload.budget(r, w) for r in (False, True) for w in (False, True)] == [1, 2, 2, 3]


def test_deepspeed_picks_the_last_subgroups():
    """ratio 0.5 over 4 sub-groups offloads the last two (DeepSpeed's subgroup_to_device)."""
    groups = offload.sub_groups([[(0, 4), (1, 4), (2, 4), (3, 4)]], sub_group_size=4, ratio=0.5)
    assert [g.offloaded for g in groups] == [False, False, True, True]
    assert isinstance(groups[0], SubGroup)
