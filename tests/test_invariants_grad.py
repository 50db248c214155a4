"""fz3.core.invariants_grad: each check passes on real runs and fails on a planted violation."""
import pytest

from fz3.core.config import Config
from fz3.core.effects import (CopyToBucket, DropGrads, HoldGrad, ReduceBucket, Slot, WaitReduce,
                              WritePartition)
from fz3.core.grads import IPGBucket, Link, bucket_add, init_grad_state
from fz3.core.invariants import InvariantError
from fz3.core.invariants_grad import check_drained, check_grad_state, check_reduce_log
from fz3.core.spec import build_spec

SPEC = build_spec([("a", 3), ("b", 4)], [("root", [0, 1], False)], world_size=2,
                  persistence_threshold=0)
CFG = Config(reduce_bucket_size=8, reduce_scatter=False)


def with_bucket(*slots, fill=None):
    state = init_grad_state(SPEC)
    link = None
    for s in slots:
        link = Link(Slot(*s), link)
        state = state._replace(params=state.params.set(s[0], state.params[s[0]]._replace(bucket=0)))
    fill = sum(s[2] for s in slots) if fill is None else fill
    return state._replace(buckets=(IPGBucket(0, "float32", link, fill),))


@pytest.mark.parametrize("state, msg", [
    (with_bucket((0, 0, 3), (1, 2, 4), fill=7), "starts at 2, expected 3"),  # overlap
    (with_bucket((0, 0, 3), (1, 4, 4), fill=8), "starts at 4, expected 3"),  # hole
    (with_bucket((0, 0, 3), fill=5), "fill 5 != sum"),
    (with_bucket((0, 0, 3), (1, 3, 4), (0, 7, 3)), "fill 10 > reduce_bucket_size 8"),
    (with_bucket((0, 0, 4)), "has numel 4, the param has 3"),
])
def test_check_grad_state_catches(state, msg):
    with pytest.raises(InvariantError, match=msg):
        check_grad_state(state, config=CFG)


def test_check_grad_state_passes_on_a_real_state():
    state = init_grad_state(SPEC)
    for p in (1, 0):
        state, _ = bucket_add(state, p, config=CFG)
        check_grad_state(state, config=CFG)


R = ReduceBucket(0, "float32", "allreduce", (Slot(0, 0, 3), Slot(1, 3, 4)), True)
COPIES = [CopyToBucket(0, "float32", 0, 0, 3), CopyToBucket(0, "float32", 1, 3, 4)]
WRITES = [WritePartition(0, 0, "copy"), WritePartition(0, 1, "copy")]
DROP = DropGrads(0, (0, 1), True)
HOLDS = [HoldGrad(*c) for c in COPIES]  # held for a reduce-scatter that reads them in place
RS = R._replace(path="reduce_scatter")


@pytest.mark.parametrize("log, reported, msg", [
    (COPIES + [R] + WRITES + [DROP], [0, 1], None),
    (COPIES + [R] + WRITES[:1] + [DROP], [0, 1], "written"),  # a write missing
    (COPIES + [R] + WRITES + [DROP, R], [0, 1], "reduced twice"),
    (COPIES + [R] + WRITES, [0, 1], "never dropped"),
    (COPIES + [R] + WRITES + [DROP], [0, 1, 1], "reported"),  # a report never reduced
    (COPIES[:1] + [R] + WRITES + [DROP], [0, 1], "do not match its slots"),
    (COPIES, [0, 1], "never reduced"),
    (HOLDS + [RS] + WRITES + [DROP], [0, 1], None),  # a hold is checked like a copy
    (HOLDS[:1] + [RS] + WRITES + [DROP], [0, 1], "do not match its slots"),
    (HOLDS, [0, 1], "never reduced"),
    (HOLDS + [R] + WRITES + [DROP], [0, 1], "held .* path 'allreduce'"),  # only p2p reads in place
    (HOLDS[:1] + COPIES[1:] + [RS] + WRITES + [DROP], [0, 1], "mixes"),
])
def test_check_reduce_log(log, reported, msg):
    if msg is None:
        check_reduce_log(log, reported, config=CFG)
        return
    with pytest.raises(InvariantError, match=msg):
        check_reduce_log(log, reported, config=CFG)


def test_check_drained():
    check_drained(init_grad_state(SPEC), [R, DROP, WaitReduce()], config=CFG)
    with pytest.raises(InvariantError, match="did not wait"):
        check_drained(init_grad_state(SPEC), [WaitReduce(), R], config=CFG)
    with pytest.raises(InvariantError, match="open buckets"):
        check_drained(with_bucket((0, 0, 3)), [WaitReduce()], config=CFG)
