"""fz3.interpreters.simulated: the N-rank world runs param and grad effects; rejects nonsense."""
import pytest
import torch

from fz3.config.config import Config
from fz3.core.effects import (AllGather, AverageGrads, CopyToBucket, DropGrads, DropSecondary, Free, HoldGrad,
                              ReduceBucket, Slot, Wait, WaitReduce, WritePartition, ZeroPartitions)
from fz3.core.grad import grads as grads_core
from fz3.core.grad.epilogue import epilogue, micro_step_end
from fz3.core.spec import build_spec
from fz3.interpreters.simulated import SimulatedWorld, SimulationError
from fz3.testing.grad_naive import PATHS, grad_spec

SPEC = build_spec([("a", 5), ("b", 2), ("c", 0)], [("root", [0, 1, 2], False)], world_size=3,
                  persistence_threshold=0)
FULL = [torch.arange(1.0, 6), torch.tensor([10.0, 20.0]), torch.zeros(0)]


def world(**cfg):
    return SimulatedWorld.from_params(SPEC, FULL, config=Config(**cfg))


def test_gather_wait_free():
    w = world()
    assert [s[0].tolist() for s in w.shards] == [[1, 2], [3, 4], [5, 0]]
    w.run([AllGather(7, (0, 1, 2), prefetch=False, forward=True)])
    assert w.full[0] == {} and 7 in w.inflight  # INFLIGHT: not readable yet
    w.run([Wait(7)])
    for r in range(3):
        assert [t.tolist() for t in (w.full[r][0], w.full[r][1], w.full[r][2])] == [
            [1, 2, 3, 4, 5], [10, 20], []]
    w.run([Free((0, 2))])
    assert list(w.full[1]) == [1]


def test_hpz_secondary_shards_are_kept_gathered_within_their_group_and_checked_fresh():
    """[Note: hpZ]: 4 ranks, groups of 2. A Free keeps each rank's half of the full value; a
    gather of secondary shards gives the full values again from its group's; one kept past new
    shards differs from them and is refused as stale."""
    spec = build_spec([("a", 5), ("b", 3)], [("root", [0, 1], False)], world_size=4, persistence_threshold=0,
                      secondary=2)
    w = SimulatedWorld.from_params(spec, [torch.arange(1.0, 6), torch.tensor([7.0, 8, 9])], config=Config())
    w.run([AllGather(0, (0, 1), False, True), Wait(0), Free((0, 1), True, (0, 1))])
    assert [w.secondary[r][0].tolist() for r in range(4)] == [[1, 2, 3], [4, 5, 0], [1, 2, 3], [4, 5, 0]]
    w.run([AllGather(1, (0, 1), False, False, (0, 1)), Wait(1)])
    assert w.full[3][0].tolist() == [1, 2, 3, 4, 5] and w.full[2][1].tolist() == [7, 8, 9]
    assert w.secondary_gathers == 1
    w.run([Free((0, 1))])
    for r in range(4):  # the optimizer step's new shards, and the secondary shards not dropped
        w.shards[r][0] = w.shards[r][0] * 2
    with pytest.raises(SimulationError, match="rank 0: param 0's secondary shards are stale"):
        w.run([AllGather(2, (0, 1), False, False, (0, 1))])
    w.run([DropSecondary((0, 1))])
    with pytest.raises(SimulationError, match="param 0 has no secondary shard to gather"):
        w.run([AllGather(3, (0,), False, False, (0,))])
    with pytest.raises(SimulationError, match="DropSecondary of param 1, which has no secondary shard"):
        w.run([DropSecondary((1,))])


@pytest.mark.parametrize("effects, msg", [
    ([AllGather(1, (0,), False, False, (0,))], "hpZ is off"),
    ([AllGather(1, (0,), False, True), Wait(1), Free((0,), True, (0,))], "hpZ is off"),
    ([Wait(1)], "not in flight"),
    ([Free((0,))], "not gathered"),
    ([AllGather(1, (0,), False, True), AllGather(1, (1,), False, True)], "reuses handle"),
    ([AllGather(1, (0,), False, True), AllGather(2, (0,), False, True)], "already gathered"),
    ([CopyToBucket(0, "float32", 0, 0, 5)], "has no grad"),
    ([HoldGrad(0, "float32", 0, 0, 5)], "has no grad"),
    ([ReduceBucket(0, "float32", "allreduce", (Slot(0, 0, 5),), True)], "nothing was copied"),
    ([WritePartition(0, 0, "copy")], "no reduced grad"),
    ([DropGrads(0, (0,), True)], "not reduced"),
    (["bogus"], "unknown effect"),
])
def test_rejects_nonsense(effects, msg):
    with pytest.raises(SimulationError, match=msg):
        world().run(effects)


def test_copy_past_capacity_is_rejected():
    w = world(reduce_bucket_size=4)
    w.accumulate_grad(0, [torch.ones(5)] * 3)
    with pytest.raises(SimulationError, match="capacity 4"):
        w.run([CopyToBucket(0, "float32", 0, 0, 5)])


def grads_of(r):
    return [torch.arange(5.0) * (r + 1), torch.tensor([1.0, -1.0]) * r]


@pytest.mark.parametrize("place", [CopyToBucket, HoldGrad])  # a held grad: the same numbers
@pytest.mark.parametrize("path", ["allreduce", "reduce_scatter"])
def test_bucket_reduce_write_average(path, place):
    w = world(reduce_bucket_size=8)
    assert torch.isnan(w.partitions[0][0]).all()  # uninitialised until written
    for p in (1, 0):
        w.accumulate_grad(p, [grads_of(r)[p] for r in range(3)])
    slots = (Slot(1, 0, 2), Slot(0, 2, 5))
    w.run([place(0, "float32", 1, 0, 2), place(0, "float32", 0, 2, 5),
           ReduceBucket(0, "float32", path, slots, True),
           WritePartition(0, 1, "copy"), WritePartition(0, 0, "copy"), DropGrads(0, (1, 0), True),
           WaitReduce(), ZeroPartitions((2,)), AverageGrads(2)])
    # sum over ranks: a = [0, 6, 12, 18, 24], b = [3, -3]; then / 2; W=3 shards of 2 and 1
    assert [w.partitions[r][0].tolist() for r in range(3)] == [[0, 3], [6, 9], [12, 0]]
    assert [w.partitions[r][1].tolist() for r in range(3)] == [[1.5], [-1.5], [0]]
    assert w.buckets == {} and w.reduced == {} and w.grads == [{}, {}, {}]


def test_loose_bucket_reads_param_grads_and_drops_them():
    w = world()
    w.accumulate_grad(0, [torch.ones(5)] * 3)
    w.accumulate_grad(0, [torch.ones(5)] * 3)  # a second graph task accumulates into param.grad
    w.run([ReduceBucket(0, "float32", "reduce_scatter", (Slot(0, 0, 5),), False),
           WritePartition(0, 0, "copy"), DropGrads(0, (0,), False)])
    assert [w.partitions[r][0].tolist() for r in range(3)] == [[6, 6], [6, 6], [6, 0]]
    assert w.grads == [{}, {}, {}]


def test_reduce_casts_to_the_comm_dtype_and_predivides():
    """float64 grads reduced in fp32, each divided by 3 first; partitions stay float64."""
    w = SimulatedWorld(SPEC, config=Config(communication_data_type="fp32"),
                       grad_dtypes=[torch.float64] * 3)
    w.accumulate_grad(0, [torch.arange(5.0, dtype=torch.float64) * 3] * 3)
    w.run([CopyToBucket(0, "float32", 0, 0, 5),
           ReduceBucket(0, "float32", "allreduce", (Slot(0, 0, 5),), True, predivide=3.0),
           WritePartition(0, 0, "copy")])
    assert w.partitions[0][0].dtype == torch.float64
    assert [w.partitions[r][0].tolist() for r in range(3)] == [[0, 3], [6, 9], [12, 0]]


def test_effect_in_another_dtype_than_the_config_says_is_rejected():
    w = world(communication_data_type="bf16")
    w.accumulate_grad(0, [torch.ones(5)] * 3)
    with pytest.raises(SimulationError, match="communication_data_type is 'bf16'"):
        w.run([CopyToBucket(0, "float32", 0, 0, 5)])


SCALINGS = [dict(prescale_gradients=True), dict(gradient_predivide_factor=3.0),
            dict(gradient_predivide_factor=0.25), dict(communication_data_type="fp32")]


@pytest.mark.parametrize("cfg", SCALINGS, ids=[str(c) for c in SCALINGS])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_scaled_reduce_gives_the_same_mean(cfg, path):
    """Random (not integer) float64 grads, 3 ranks, 2 micro-steps, a bucket smaller than some
    grads: with a pre-division or a comm dtype the partitions are the plain mean gradient, up
    to rounding (fp32 comm: fp32 rounding)."""
    numels, w, gas = [5, 11, 2, 7], 3, 2
    spec = grad_spec(numels, w)
    gen = torch.Generator().manual_seed(0)
    grads = [[[torch.randn(n, generator=gen, dtype=torch.float64) for _ in range(w)] for n in numels]
             for _ in range(gas)]  # [micro-step][param][rank]
    config = Config(reduce_bucket_size=8, gradient_accumulation_steps=gas, **PATHS[path], **cfg)
    world_ = SimulatedWorld(spec, config=config, grad_dtypes=[torch.float64] * len(numels))
    state = grads_core.init_grad_state(spec)
    for step in grads:
        for p in reversed(range(len(numels))):
            world_.accumulate_grad(p, step[p])
            state, eff = grads_core.bucket_add(state, p, config=config, dtype="float64")
            world_.run(eff)
        state, eff = epilogue(state, config=config)
        world_.run(eff)
        state, eff = micro_step_end(state, config=config)  # the loop's step()
        world_.run(eff)
    tol = dict(rtol=1e-6, atol=1e-6) if config.communication_data_type else dict(rtol=1e-12, atol=1e-12)
    for p, n in enumerate(numels):
        mean = sum(g for step in grads for g in step[p]) / (w * gas)
        s = -(-n // w)
        padded = torch.cat([mean, mean.new_zeros(s * w - n)])
        for r in range(w):
            torch.testing.assert_close(world_.partitions[r][p], padded[r * s:(r + 1) * s], **tol)
