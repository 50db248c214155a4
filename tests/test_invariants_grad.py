"""fz3.core.grad.invariants: each check passes on real runs and fails on a planted violation."""
import pytest

from fz3.config.config import Config
from fz3.core.effects import (CopyToBucket, DropGrads, HoldGrad, ReduceBucket, Slot, WaitReduce,
                              WritePartition)
from fz3.core.grad.grads import IPGBucket, Link, bucket_add, init_grad_state
from fz3.core.param.invariants import InvariantError, check_state
from fz3.core.grad.invariants import check_drained, check_grad_state, check_reduce_log
from fz3.core.spec import build_spec
from fz3.core.param.state import initial_state

SPEC = build_spec([("a", 3), ("b", 4)], [("root", [0, 1], False)], world_size=2,
                  persistence_threshold=0)
CFG = Config(reduce_bucket_size=8, reduce_scatter=False)
NO_OVERLAP = Config(reduce_bucket_size=8, reduce_scatter=False, overlap_comm=False)


def with_bucket(*slots, fill=None):
    state = init_grad_state(SPEC)
    link = None
    for s in slots:
        link = Link(Slot(*s), link)
        state = state._replace(params=state.params.set(s[0], state.params[s[0]]._replace(bucket=0)))
    fill = sum(s[2] for s in slots) if fill is None else fill
    return state._replace(buckets=(IPGBucket(0, "float32", link, fill),))


def two_buckets(*dtypes):
    """Param p alone in bucket p, of dtypes[p]."""
    state = init_grad_state(SPEC)
    for p in range(len(dtypes)):
        state = state._replace(params=state.params.set(p, state.params[p]._replace(bucket=p)))
    numel = [SPEC.params[p].numel for p in range(len(dtypes))]
    return state._replace(buckets=tuple(IPGBucket(p, d, Link(Slot(p, 0, numel[p]), None), numel[p])
                                        for p, d in enumerate(dtypes)))


def records_bucket(param, bucket):
    """Both params in bucket 0, but `param` records `bucket`."""
    state = with_bucket((0, 0, 3), (1, 3, 4))
    wrong = state.params[param]._replace(bucket=bucket)
    return state._replace(params=state.params.set(param, wrong))


@pytest.mark.parametrize("state, msg", [
    (with_bucket((0, 0, 3), (1, 2, 4), fill=7), "starts at 2, expected 3"),  # overlap
    (with_bucket((0, 0, 3), (1, 4, 4), fill=8), "starts at 4, expected 3"),  # hole
    (with_bucket((0, 0, 3), fill=5), "fill 5 != sum"),
    (with_bucket((0, 0, 3), (1, 3, 4), (0, 7, 3)), r"fill 10 > its capacity 8 \(reduce_bucket_size 8"),
    (with_bucket((0, 0, 4)), "has numel 4, the param has 3"),
    (with_bucket((0, 0, 3), (0, 3, 3)), r"bucket 0 holds params \[0\] more than once"),  # twice
    (with_bucket((0, 0, 3))._replace(buckets=(IPGBucket(0, "float32", None, 0),)),
     r"bucket 0 \(float32\) is open but empty"),
    (two_buckets("float32", "bfloat16"), r"sorted by dtype; got \['float32', 'bfloat16'\]"),
    (two_buckets("float32", "float32"), r"one per dtype.*got \['float32', 'float32'\]"),
    (records_bucket(0, 1), "param 0 sits in bucket 0 but records bucket 1"),
    (records_bucket(1, None), "param 1 sits in bucket 0 but records bucket None"),
    (with_bucket((0, 0, 3))._replace(micro_step=1), r"micro_step 1 outside \[0, 1\)"),  # step() calls mod gas
    (with_bucket((0, 0, 3))._replace(micro_step=-1), r"micro_step -1 outside \[0, 1\)"),
    (with_bucket((0, 0, 3))._replace(averaged=True), r"averaged with 1 open bucket"),
])
def test_check_grad_state_catches(state, msg):
    with pytest.raises(InvariantError, match=msg):
        check_grad_state(state, config=CFG)


@pytest.mark.parametrize("state", [
    with_bucket((0, 0, 3), (1, 3, 4)),  # fill 7 <= 8, each param once
    with_bucket((0, 0, 3), (1, 3, 4))._replace(micro_step=0),  # step() calls mod gas: below it
    two_buckets("bfloat16", "float32"),  # one per dtype, sorted
])
def test_check_grad_state_passes_at_the_bounds(state):
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
    ([R] + WRITES + [DROP], [0, 1], r"bucket 0: copies \[\] do not match its slots"),  # none
    (COPIES + [R] + WRITES + [DROP._replace(contiguous=False)], [0, 1],
     r"dropped DropGrads\(bucket=0, params=\(0, 1\), contiguous=False\)"),
    (COPIES + [R] + WRITES + [DROP._replace(params=(0,))], [0, 1],
     r"bucket 0: slots \(0, 1\), written \[0, 1\], dropped DropGrads\(bucket=0, params=\(0,\)"),
    ([DROP], [], "DropGrads of bucket 0, which was not reduced"),
    (COPIES + [R] + WRITES + [DROP, DropGrads(0, (0, 1), True)], [0, 1],
     "DropGrads of bucket 0, which was not reduced"),  # dropped twice
    (WRITES[1:], [], "WritePartition of param 1 from bucket 0, which is not"),
])
def test_check_reduce_log(log, reported, msg):
    expect_reduce_log(log, reported, msg, CFG)


def expect_reduce_log(log, reported, msg, config):
    """msg None: the log passes; else check_reduce_log raises matching msg."""
    if msg is None:
        check_reduce_log(log, reported, config=config)
        return
    with pytest.raises(InvariantError, match=msg):
        check_reduce_log(log, reported, config=config)


NC = Config(reduce_bucket_size=8, contiguous_gradients=False)  # a re-report merges into param.grad
R0 = ReduceBucket(0, "float32", "reduce_scatter", (Slot(0, 0, 3),), False)  # param 0 alone
R1 = ReduceBucket(1, "float32", "reduce_scatter", (Slot(0, 0, 3),), False)
NC_LOG = [R0, WritePartition(0, 0, "copy"), DropGrads(0, (0,), False)]


@pytest.mark.parametrize("log, reported, msg", [
    (NC_LOG, [0], None),
    (NC_LOG, [0, 0], None),  # reported twice, merged: reduced once
    (NC_LOG, [0, 1], r"reduced \{0: 1\} != reported \{0: 1, 1: 1\}"),  # 1 never reduced
    (NC_LOG + [R1, WritePartition(1, 0, "add"), DropGrads(1, (0,), False)], [0],
     r"reduced \{0: 2\} != reported \{0: 1\}"),  # reduced more often than reported
])
def test_check_reduce_log_without_contiguous_gradients(log, reported, msg):
    expect_reduce_log(log, reported, msg, NC)


def test_check_drained():
    check_drained(init_grad_state(SPEC), [R, DROP, WaitReduce()], config=CFG)
    with pytest.raises(InvariantError, match="did not wait"):
        check_drained(init_grad_state(SPEC), [WaitReduce(), R], config=CFG)
    with pytest.raises(InvariantError, match="open buckets"):
        check_drained(with_bucket((0, 0, 3)), [WaitReduce()], config=CFG)


@pytest.mark.parametrize("log, waited", [
    ([WaitReduce(), R, WaitReduce()], True),  # the last wait counts
    ([R, WaitReduce(), R1], False),  # a reduce after the last wait
    ([R], False),  # no wait at all
    ([WaitReduce()], True),  # nothing reduced
    ([], False),
])
def test_check_drained_wants_a_wait_after_the_last_reduce(log, waited):
    state = init_grad_state(SPEC)
    check_drained(state, log, config=NO_OVERLAP)
    if waited:
        check_drained(state, log, config=CFG)
        return
    with pytest.raises(InvariantError, match="did not wait for the reduce stream"):
        check_drained(state, log, config=CFG)


def test_param_checkers_raise_invariant_error_naming_what_broke():
    """fz3.core.param.invariants fails the same way: an InvariantError with the message."""
    with pytest.raises(InvariantError, match="live numel is 5 but the gathered params add up to 0"):
        check_state(initial_state(SPEC)._replace(live_numel=5))
