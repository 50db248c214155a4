"""fz3.core.grad.grads: bucket_add and flush, table-driven."""
import pytest

from fz3.config.config import Config
from fz3.core.effects import (ADD, COPY, CopyToBucket, DropGrads, HoldGrad, ReduceBucket, Slot,
                              WritePartition)
from fz3.core.grad.epilogue import epilogue, micro_step_end, optimizer_step
from fz3.core.grad.grads import (NEVER, GradError, ParamGrad, bucket_add, flush, grad_route,
                            init_grad_state, resumed)
from fz3.core.grad.invariants import check_grad_state
from fz3.core.spec import build_spec

AR = dict(reduce_scatter=False)  # contiguous all-reduce path
RS = dict(reduce_scatter=True)
LOOSE = dict(contiguous_gradients=False, reduce_scatter=True)


def grad_spec(numels, world_size):
    return build_spec([(f"p{i}", n) for i, n in enumerate(numels)],
                      [("root", range(len(numels)), False)], world_size=world_size,
                      persistence_threshold=0)


def run(numels, order, *, world_size=2, **cfg):
    config = Config(**cfg)
    state = init_grad_state(grad_spec(numels, world_size))
    out = []
    for p in order:
        state, eff = bucket_add(state, p, config=config)
        check_grad_state(state, config=config)
        out.append(eff)
    return state, out, config


def reduced(bucket, slots, path="allreduce", contiguous=True, modes=None, dtype="float32"):
    """The effects of one flush of `slots` [(param, offset, numel)]."""
    ps = tuple(s[0] for s in slots)
    modes = modes or [COPY] * len(ps)
    return (ReduceBucket(bucket, dtype, path, tuple(Slot(*s) for s in slots), contiguous),
            *(WritePartition(bucket, p, m) for p, m in zip(ps, modes)),
            DropGrads(bucket, ps, contiguous))


@pytest.mark.parametrize("numels, cap, order, cfg, expected", [
    # fits exactly: two copies, nothing reduced yet
    ([3, 5], 8, [0, 1], AR, [(CopyToBucket(0, "float32", 0, 0, 3),),
                             (CopyToBucket(0, "float32", 1, 3, 5),)]),
    # would overflow: flush bucket 0 first, then open bucket 1
    ([3, 6], 8, [0, 1], AR, [(CopyToBucket(0, "float32", 0, 0, 3),),
                             reduced(0, [(0, 0, 3)]) + (CopyToBucket(1, "float32", 1, 0, 6),)]),
    # bigger than the whole bucket: flush, then reduced on its own from param.grad (no copy)
    ([3, 20], 8, [0, 1], AR, [(CopyToBucket(0, "float32", 0, 0, 3),),
                              reduced(0, [(0, 0, 3)]) + reduced(1, [(1, 0, 20)], contiguous=False)]),
    # oversized first: nothing to flush
    ([20, 3], 8, [0, 1], RS, [reduced(0, [(0, 0, 20)], "reduce_scatter", contiguous=False),
                              (CopyToBucket(1, "float32", 1, 0, 3),)]),
    # no contiguous_gradients: slots are bookkeeping only, no copies
    ([3, 5, 4], 8, [2, 0, 1], LOOSE, [(), (), reduced(0, [(2, 0, 4), (0, 4, 3)], "reduce_scatter",
                                                       contiguous=False)]),
    # numel 0 takes a slot of size 0
    ([0, 8], 8, [0, 1], AR, [(CopyToBucket(0, "float32", 0, 0, 0),),
                             (CopyToBucket(0, "float32", 1, 0, 8),)]),
    # a one-element bucket: every grad but numel <= 1 is reduced alone
    ([1, 2], 1, [0, 1], AR, [(CopyToBucket(0, "float32", 0, 0, 1),),
                             reduced(0, [(0, 0, 1)]) + reduced(1, [(1, 0, 2)], contiguous=False)]),
])
def test_bucket_add(numels, cap, order, cfg, expected):
    _, effects, _ = run(numels, order, reduce_bucket_size=cap, **cfg)
    assert effects == expected


def test_flush_reduces_open_bucket_on_configured_path():
    for cfg, path in ((AR, "allreduce"), (RS, "reduce_scatter")):
        state, _, config = run([3, 5], [1, 0], reduce_bucket_size=100, **cfg)
        state, eff = flush(state, config=config)
        assert eff == reduced(0, [(1, 0, 5), (0, 5, 3)], path)
        assert state.buckets == ()
        assert flush(state, config=config)[1] == ()  # nothing open: nothing to do


def test_one_bucket_per_dtype():
    config = Config(reduce_bucket_size=100)
    state = init_grad_state(grad_spec([3, 4, 5], 1))
    for p, dt in ((0, "float32"), (1, "bfloat16"), (2, "float32")):
        state, eff = bucket_add(state, p, config=config, dtype=dt)
    assert [(b.dtype, b.fill) for b in state.buckets] == [("bfloat16", 4), ("float32", 8)]
    state, eff = flush(state, config=config, dtype="float32")
    assert [e.bucket for e in eff if isinstance(e, ReduceBucket)] == [0]
    state, eff = flush(state, config=config)
    assert [(e.bucket, e.dtype) for e in eff if isinstance(e, ReduceBucket)] == [(1, "bfloat16")]


def test_double_report_names_the_param():
    state, _, config = run([3, 4], [1])
    with pytest.raises(GradError, match=r"'p1' \(id 1\) reported twice"):
        bucket_add(state, 1, config=config)


def test_unknown_param():
    state, _, config = run([3], [])
    with pytest.raises(GradError, match="no param with id 5"):
        bucket_add(state, 5, config=config)


def test_param_id_one_past_the_last_is_refused_with_the_id_range():
    """The id check's upper bound is exclusive (id == number of params is unknown, refused as a
    GradError rather than an IndexError), and the message gives the valid range 0..n-1."""
    state, _, config = run([3, 4, 5], [])
    with pytest.raises(GradError, match=r"no param with id 3 \(ids run 0\.\.2\)"):
        bucket_add(state, 3, config=config)


def test_oversized_grad_records_the_bucket_it_was_reduced_in():
    """A grad reduced alone still gets a BucketId of its own (next_bucket advances), and its
    ParamGrad records that bucket, in the first graph task and in a later one."""
    state, _, config = run([3, 20], [0, 1], reduce_bucket_size=8, **AR)
    assert state.params[1] == ParamGrad(reported=0, task=0, bucket=1, written=0, got=0)
    assert state.next_bucket == 2 and [b.id for b in state.buckets] == []
    state, eff = bucket_add(state, 1, config=config, graph_task=1)
    assert eff == reduced(2, [(1, 0, 20)], contiguous=False, modes=[ADD])
    assert state.params[1] == ParamGrad(reported=0, task=1, bucket=2, written=0, got=0)
    assert state.next_bucket == 3


def test_new_graph_task_flushes_only_the_stale_bucket_of_its_dtype():
    """A second report in a new graph task flushes the bucket holding the first grad, and only
    that one: the open bucket of another dtype stays open with its slots."""
    config = Config(reduce_bucket_size=100, **AR)
    state = init_grad_state(grad_spec([3, 4], 2))
    state, _ = bucket_add(state, 0, config=config, dtype="float32")  # bucket 0
    state, _ = bucket_add(state, 1, config=config, dtype="bfloat16")  # bucket 1
    state, eff = bucket_add(state, 0, config=config, dtype="float32", graph_task=1)
    assert eff == reduced(0, [(0, 0, 3)]) + (CopyToBucket(2, "float32", 0, 0, 3),)
    assert [(b.id, b.dtype, b.slots) for b in state.buckets] == [
        (1, "bfloat16", (Slot(1, 0, 4),)), (2, "float32", (Slot(0, 0, 3),))]


def test_overflow_flushes_only_the_bucket_of_its_dtype():
    """A grad that would overflow its comm dtype's bucket flushes that bucket alone; the bucket
    of another dtype stays open."""
    config = Config(reduce_bucket_size=8, **AR)
    state = init_grad_state(grad_spec([3, 4, 6], 2))
    state, _ = bucket_add(state, 0, config=config, dtype="float32")  # bucket 0, fill 3
    state, _ = bucket_add(state, 1, config=config, dtype="bfloat16")  # bucket 1, fill 4
    state, eff = bucket_add(state, 2, config=config, dtype="bfloat16")  # 4 + 6 > 8
    assert eff == (reduced(1, [(1, 0, 4)], dtype="bfloat16")
                   + (CopyToBucket(2, "bfloat16", 2, 0, 6),))
    assert [(b.id, b.dtype, b.fill) for b in state.buckets] == [(2, "bfloat16", 6),
                                                                 (0, "float32", 3)]


def test_stale_flush_and_overflow_flush_both_reach_the_effects():
    """A report in a new graph task whose grad dtype differs from its first one's flushes the
    stale bucket (of the first dtype), then, when the grad overflows the bucket of its new dtype,
    that bucket too: both reduces are returned, stale first, then the placement."""
    config = Config(reduce_bucket_size=8, **AR)
    state = init_grad_state(grad_spec([3, 6], 2))
    state, _ = bucket_add(state, 0, config=config, dtype="bfloat16")  # bucket 0, fill 3
    state, _ = bucket_add(state, 1, config=config, dtype="float32")  # bucket 1, fill 6
    state, eff = bucket_add(state, 0, config=config, dtype="float32", graph_task=1)  # 6 + 3 > 8
    assert eff == (reduced(0, [(0, 0, 3)], dtype="bfloat16") + reduced(1, [(1, 0, 6)])
                   + (CopyToBucket(2, "float32", 0, 0, 3),))
    assert [(b.id, b.dtype, b.fill) for b in state.buckets] == [(2, "float32", 3)]


def test_new_graph_task_contiguous_flushes_the_stale_bucket():
    state, _, config = run([3, 4], [0, 1], reduce_bucket_size=100)
    state, eff = bucket_add(state, 0, config=config, graph_task=1)
    assert eff == (reduced(0, [(0, 0, 3), (1, 3, 4)], "reduce_scatter")
                   + (CopyToBucket(1, "float32", 0, 0, 3),))
    state, eff = flush(state, config=config)
    assert [e for e in eff if isinstance(e, WritePartition)] == [WritePartition(1, 0, ADD)]


def test_new_graph_task_loose_merges_into_param_grad():
    state, _, config = run([3, 4], [0, 1], reduce_bucket_size=100, **LOOSE)
    state, eff = bucket_add(state, 0, config=config, graph_task=1)
    assert eff == ()  # autograd summed the new grad into param.grad; the open slot reads it
    with pytest.raises(GradError, match="'p0'"):
        bucket_add(state, 0, config=config, graph_task=1)


def test_flags_reset_by_epilogue_and_write_modes_follow_the_window():
    state, _, config = run([3, 4], [0], reduce_bucket_size=100, gradient_accumulation_steps=2)
    state, eff = epilogue(state, config=config)
    assert WritePartition(0, 0, COPY) in eff
    for p, mode in ((0, ADD), (1, COPY)):  # p1's first grad of the window comes at micro-step 1
        state, _ = bucket_add(state, p, config=config)  # no "reported twice": flags were reset
        state, eff = flush(state, config=config)
        assert [e.mode for e in eff if isinstance(e, WritePartition)] == [mode]
    state, _ = epilogue(state, config=config)
    for _ in range(2):  # the window closes at its second step()
        state, _ = micro_step_end(state, config=config)
    state, _ = optimizer_step(state, config=config)
    state, _ = bucket_add(state, 0, config=config)
    assert [e.mode for e in flush(state, config=config)[1] if isinstance(e, WritePartition)] == [COPY]


def test_transitions_do_not_touch_their_input():
    state, _, config = run([3, 4], [0], reduce_bucket_size=100)
    before = (state.buckets, list(state.params), state.next_bucket)
    bucket_add(state, 1, config=config)
    flush(state, config=config)
    assert (state.buckets, list(state.params), state.next_bucket) == before


# ---- the comm dtype and the pre-division (fz3/core/grad/grads.py, [Note: pre-division]) ---------

@pytest.mark.parametrize("comm, grad_dtypes, buckets", [
    (None, ["bfloat16", "float32"], ["bfloat16", "float32"]),  # each grad's own dtype
    ("fp32", ["bfloat16", "bfloat16"], ["float32", "float32"]),  # bf16 grads reduced in fp32
    ("bf16", ["float32", "bfloat16"], ["bfloat16", "bfloat16"]),  # one bucket for both
    ("fp16", ["float32", "float32"], ["float16", "float16"]),
])
def test_bucket_dtype_is_the_comm_dtype(comm, grad_dtypes, buckets):
    config = Config(reduce_bucket_size=100, communication_data_type=comm, **AR)
    state = init_grad_state(grad_spec([3, 4], 2))
    copies = []
    for p, dt in enumerate(grad_dtypes):
        state, eff = bucket_add(state, p, config=config, dtype=dt)
        copies += [e.dtype for e in eff if isinstance(e, CopyToBucket)]
    assert copies == buckets
    assert [b.dtype for b in state.buckets] == sorted(set(buckets))
    _, eff = flush(state, config=config)
    assert [e.dtype for e in eff if isinstance(e, ReduceBucket)] == sorted(set(buckets))


def test_oversized_grad_is_reduced_in_the_comm_dtype():
    config = Config(reduce_bucket_size=4, communication_data_type="fp32", **RS)
    _, eff = bucket_add(init_grad_state(grad_spec([9], 2)), 0, config=config, dtype="bfloat16")
    assert eff[0] == ReduceBucket(0, "float32", "reduce_scatter", (Slot(0, 0, 9),), False)


@pytest.mark.parametrize("world_size, cfg, predivide", [
    (4, {}, 1.0),  # DeepSpeed's defaults: fz3 divides once, at the boundary
    (4, dict(prescale_gradients=True), 4.0),  # each grad / W before the reduce
    (1, dict(prescale_gradients=True), 1.0),
    (3, dict(gradient_predivide_factor=2.5), 2.5),  # postscale: / f before, undone after
    (3, dict(prescale_gradients=True, gradient_predivide_factor=2.5), 3.0),  # f ignored, as in DS
])
def test_reduce_carries_the_predivide(world_size, cfg, predivide):
    for path in (AR, RS, LOOSE):
        config = Config(reduce_bucket_size=4, **path, **cfg)
        state = init_grad_state(grad_spec([3, 9], world_size))
        state, _ = bucket_add(state, 0, config=config)
        state, alone = bucket_add(state, 1, config=config)  # flushes p0, then p1 alone
        reduces = [e for e in alone if isinstance(e, ReduceBucket)]
        assert [e.predivide for e in reduces] == [predivide, predivide], (path, reduces)


# ---- the route: copy into the bucket or hold the grad ([Note: copy or hold]) ----------------

@pytest.mark.parametrize("contiguous, reduce_scatter, in_place, want", [
    (True, True, True, HoldGrad),  # the carrier sends from each grad: the copy is saved
    (True, True, False, CopyToBucket),  # a packing reduce-scatter (NCCL, gloo's own)
    (True, False, True, CopyToBucket),  # an all-reduce reduces the flat bucket itself
    (True, False, False, CopyToBucket),
    (False, True, True, None),  # no contiguous bucket: the reduce reads param.grad
    (False, True, False, None),
    (False, False, True, None),  # no bucket to all-reduce: the reduce-scatter path, as DeepSpeed's
    (False, False, False, None),
])
def test_grad_route(contiguous, reduce_scatter, in_place, want):
    if want is ValueError:
        with pytest.raises(ValueError, match="contiguous_gradients=False needs reduce_scatter"):
            Config(contiguous_gradients=contiguous, reduce_scatter=reduce_scatter)
        return
    config = Config(contiguous_gradients=contiguous, reduce_scatter=reduce_scatter,
                    reduce_bucket_size=8)
    state = init_grad_state(grad_spec([3, 20], 2), in_place_reduce_scatter=in_place)
    assert grad_route(state, config) is want
    state, placed = bucket_add(state, 0, config=config)
    assert placed == (() if want is None else (want(0, "float32", 0, 0, 3),))
    _, alone = bucket_add(state, 1, config=config)  # bigger than the bucket: never placed
    assert not [e for e in alone if isinstance(e, (CopyToBucket, HoldGrad))]


def test_held_grads_reduce_and_drop_as_contiguous():
    config = Config(reduce_bucket_size=100, communication_data_type="bf16", **RS)
    state = init_grad_state(grad_spec([3, 5], 2), in_place_reduce_scatter=True)
    state, held = bucket_add(state, 1, config=config)
    state, more = bucket_add(state, 0, config=config)
    assert held + more == (HoldGrad(0, "bfloat16", 1, 0, 5), HoldGrad(0, "bfloat16", 0, 5, 3))
    _, eff = flush(state, config=config)
    assert eff[0] == ReduceBucket(0, "bfloat16", "reduce_scatter", (Slot(1, 0, 5), Slot(0, 5, 3)), True)
    assert eff[-1] == DropGrads(0, (1, 0), True)


def _reduced(state, config, order):
    """Report `order`'s grads, then flush: -> the slots of each ReduceBucket, in order."""
    out = []
    for p in order:
        state, eff = bucket_add(state, p, config=config)
        out += [tuple(s.param for s in e.slots) for e in eff if isinstance(e, ReduceBucket)]
    _, eff = flush(state, config=config)
    return out + [tuple(s.param for s in e.slots) for e in eff if isinstance(e, ReduceBucket)]


def test_held_grads_are_reduced_at_the_carriers_hold_budget():
    """[Note: hold budget]: held buckets are reduced at the smaller of reduce_bucket_size and
    the hold budget; a grad bigger than the budget is reduced alone; copied buckets keep
    reduce_bucket_size."""
    config = Config(reduce_bucket_size=100, **RS)
    spec = grad_spec([3, 5, 4, 9, 2], 2)
    held = init_grad_state(spec, in_place_reduce_scatter=True, hold_budget=8)
    assert _reduced(held, config, [0, 1, 2, 3, 4]) == [(0, 1), (2,), (3,), (4,)]
    state, eff = bucket_add(held, 3, config=config)  # 9 > 8: never placed, reduced from param.grad
    assert not [e for e in eff if isinstance(e, HoldGrad)] and not eff[0].contiguous
    copied = init_grad_state(spec, in_place_reduce_scatter=False, hold_budget=8)
    assert _reduced(copied, config, [0, 1, 2, 3, 4]) == [(0, 1, 2, 3, 4)]
    no_budget = init_grad_state(spec, in_place_reduce_scatter=True)
    assert _reduced(no_budget, config, [0, 1, 2, 3, 4]) == [(0, 1, 2, 3, 4)]
    smaller = Config(reduce_bucket_size=6, **RS)  # reduce_bucket_size below the budget wins
    assert _reduced(held, smaller, [0, 4, 1]) == [(0, 4), (1,)]
    assert resumed(held, window=3, backward=5).hold_budget == 8


@pytest.mark.parametrize("bad", [-1, 2.5, True, None])
def test_a_bad_hold_budget_is_named(bad):
    with pytest.raises(ValueError, match=f"hold_budget must be an int >= 0.*{bad!r}"):
        init_grad_state(grad_spec([3], 1), hold_budget=bad)


def test_the_route_flag_is_static():
    config = Config(reduce_bucket_size=100, gradient_accumulation_steps=1, **RS)
    state = init_grad_state(grad_spec([3], 1), in_place_reduce_scatter=True)
    state, _ = bucket_add(state, 0, config=config)
    state, _ = epilogue(state, config=config)
    state, _ = micro_step_end(state, config=config)
    state, _ = optimizer_step(state, config=config)
    assert state.in_place_reduce_scatter
    assert bucket_add(state, 0, config=config)[1] == (HoldGrad(1, "float32", 0, 0, 3),)  # bucket 1
    assert not init_grad_state(grad_spec([3], 1)).in_place_reduce_scatter  # the default: copy


def test_a_stand_in_is_reduced_and_written_but_is_no_grad():
    """Zeros standing in for a leaf param's missing grad are reduced and written like a grad (every
    rank reduces the same), but `got` stays: the param had no grad in this window ([Note: no grad,
    no step]); a real grad in the same window sets it."""
    state, _, config = run([3, 4], [], reduce_bucket_size=100, **AR)
    state, eff = bucket_add(state, 0, config=config, stand_in=True)
    assert state.params[0].got == NEVER and state.params[0].reported == 0
    state, _ = flush(state, config=config)
    assert state.params[0].written == 0 and state.params[0].got == NEVER
    state, _ = bucket_add(state, 1, config=config)
    assert state.params[1].got == 0
