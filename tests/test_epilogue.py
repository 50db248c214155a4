"""fz3.core.grad.epilogue: the end of a backward, the step() that closes the window, zero_grad, optimizer_step."""
import pytest

from fz3.config.config import Config
from fz3.core.effects import (ADD, COPY, AverageGrads, FreePartitions, ReduceBucket, WaitReduce, WritePartition,
                              ZeroPartitions)
from fz3.core.grad.epilogue import (at_boundary, epilogue, grad_divisor, is_boundary, micro_step_end, never_written,
                                    optimizer_step, without_grad, zero_grads)
from fz3.core.grad.grads import GradError, bucket_add, init_grad_state
from fz3.core.grad.invariants import check_drained
from fz3.core.spec import build_spec


def grad_spec(numels, world_size):
    return build_spec([(f"p{i}", n) for i, n in enumerate(numels)],
                      [("root", range(len(numels)), False)], world_size=world_size,
                      persistence_threshold=0)


def kinds(effects):
    return [type(e).__name__ for e in effects]


@pytest.mark.parametrize("world_size, gas, overlap, reports, expected", [
    # one micro-step: flush, wait; the step(): zero p1 (never reported), average by W
    (2, 1, True, [[0]], [["ReduceBucket", "WritePartition", "DropGrads", "WaitReduce"]]),
    # no overlap_comm: nothing to wait for
    (3, 1, False, [[0, 1]], [["ReduceBucket", "WritePartition", "WritePartition", "DropGrads"]]),
    # two micro-steps: each backward only flushes and waits; p1 first written at micro-step 1
    (4, 2, True, [[0], [1, 0]], [["ReduceBucket", "WritePartition", "DropGrads", "WaitReduce"],
                                 ["ReduceBucket", "WritePartition", "WritePartition", "DropGrads", "WaitReduce"]]),
    # an empty backward is still a backward
    (1, 2, True, [[], []], [["WaitReduce"], ["WaitReduce"]]),
])
def test_epilogue_and_step_effects(world_size, gas, overlap, reports, expected):
    """Each backward's epilogue flushes (and waits); the gas-th step() zeroes what no grad
    reached and averages by W x gas; the step()s before it only move the micro-step."""
    config = Config(gradient_accumulation_steps=gas, overlap_comm=overlap)
    state = init_grad_state(grad_spec([3, 4], world_size))
    for m, (ps, want) in enumerate(zip(reports, expected)):
        for p in ps:
            state, _ = bucket_add(state, p, config=config)
        state, eff = epilogue(state, config=config)
        check_drained(state, eff, config=config)
        assert kinds(eff) == want
        assert state.backward == m + 1 and state.micro_backwards == 1
        assert is_boundary(state, config=config) == (m == gas - 1)
        state, step_eff = micro_step_end(state, config=config)
        assert state.micro_step == (m + 1) % gas and state.micro_backwards == 0
        if m < gas - 1:
            assert step_eff == () and not at_boundary(state, config=config) and state.committed
    assert at_boundary(state, config=config)
    assert step_eff[-1] == AverageGrads(world_size * gas)
    written = {p for ps in reports for p in ps}
    zero = [e for e in step_eff if isinstance(e, ZeroPartitions)]
    assert (zero[0].params if zero else ()) == tuple(p for p in (0, 1) if p not in written)


@pytest.mark.parametrize("w, gas", [(1, 1), (2, 3), (4, 4), (3, 1)])
def test_divisor_is_world_size_times_accumulation_steps(w, gas):
    assert grad_divisor(w, gas) == w * gas


def test_several_backwards_before_one_step_add():
    """Two backwards, then one step() at gas 1 (a GAN's discriminator): the second writes add to
    the first's, and the boundary divides by W x gas once, whatever the number of backwards."""
    config = Config(gradient_accumulation_steps=1, reduce_bucket_size=100)
    state = init_grad_state(grad_spec([3, 4], 2))
    writes = []
    for _ in range(2):
        state, eff = bucket_add(state, 0, config=config)
        state, eff2 = epilogue(state, config=config)
        writes += [e.mode for e in eff + eff2 if isinstance(e, WritePartition)]
    assert writes == [COPY, ADD] and state.micro_backwards == 2
    state, eff = micro_step_end(state, config=config)
    assert eff == (ZeroPartitions((1,)), AverageGrads(2)) and at_boundary(state, config=config)


@pytest.mark.parametrize("managed, override, gas, steps, closes", [
    (True, None, 3, 3, [False, False, True]),
    (True, True, 3, 2, [True, True]),  # set_gradient_accumulation_boundary(True): every step()
    (True, False, 1, 2, [False, False]),  # ... False: none
    (False, None, 3, 3, [True, True, True]),  # managed_gradient_accumulation false: every step()
])
def test_the_boundary_is_decided_by_step_calls(managed, override, gas, steps, closes):
    """DeepSpeed's rule: (micro_steps + 1) % gas == 0, the override, or every step() unmanaged."""
    config = Config(gradient_accumulation_steps=gas, managed_gradient_accumulation=managed)
    state = init_grad_state(grad_spec([3], 2))
    got = []
    for _ in range(steps):
        state, _ = epilogue(state, config=config)
        state, _ = micro_step_end(state, config=config, override=override)
        got.append(at_boundary(state, config=config))
        if at_boundary(state, config=config):
            state, _ = optimizer_step(state, config=config)
    assert got == closes


def test_window_lifecycle_and_errors():
    config = Config(gradient_accumulation_steps=2)
    state = init_grad_state(grad_spec([3], 2))
    with pytest.raises(GradError, match="before the boundary's step"):
        optimizer_step(state, config=config)
    state, _ = epilogue(state, config=config)
    state, _ = micro_step_end(state, config=config)
    state, _ = epilogue(state, config=config)
    state, _ = epilogue(state, config=config)  # a second backward in the micro-step adds
    state, _ = micro_step_end(state, config=config)
    with pytest.raises(GradError, match="averaged"):
        epilogue(state, config=config)
    with pytest.raises(GradError, match="averaged"):
        bucket_add(state, 0, config=config)
    with pytest.raises(GradError, match="averaged"):
        micro_step_end(state, config=config)
    state, eff = optimizer_step(state, config=config)
    assert eff == (FreePartitions(),) and state.micro_step == 0 and state.window == 1  # memory back
    assert not state.committed and state.micro_backwards == 0
    assert never_written(state) == (0,)  # a new window: nothing written yet


def test_zero_grad_drops_the_grads_since_the_last_step():
    """[Note: zero_grad in a window]: with nothing older in the window, the backwards since the
    last step() are forgotten (the next write copies, the memory goes back); after a step() off
    the boundary took grads in, it is refused, naming both ways out; with nothing to drop, a
    no-op."""
    config = Config(gradient_accumulation_steps=2, reduce_bucket_size=100)
    state = init_grad_state(grad_spec([3, 4], 2))
    assert zero_grads(state, config=config) == (state, ())
    state, _ = bucket_add(state, 0, config=config)
    state, _ = epilogue(state, config=config)
    state, eff = zero_grads(state, config=config)
    assert eff == (FreePartitions(),) and state.micro_backwards == 0
    assert never_written(state) == (0, 1) and without_grad(state, [True, True]) == (0, 1)
    state, eff = bucket_add(state, 0, config=config)
    state, eff2 = epilogue(state, config=config)
    assert [e.mode for e in eff + eff2 if isinstance(e, WritePartition)] == [COPY]
    state, _ = micro_step_end(state, config=config)  # off the boundary: the grads join the window
    assert zero_grads(state, config=config)[0] is state  # nothing since the step(): nothing to drop
    state, _ = bucket_add(state, 1, config=config)
    state, _ = epilogue(state, config=config)
    with pytest.raises(GradError, match=r"(?s)after 1 backward\(s\) since a step\(\).*right after step\(\)"):
        zero_grads(state, config=config)


def test_optimizer_step_refuses_open_buckets_and_says_why():
    """optimizer_step at the boundary with an IPG bucket still open is refused, and the error says
    so. The transitions never leave one open there (the epilogue flushes, step() refuses open
    buckets), so the state is made by hand."""
    config = Config(gradient_accumulation_steps=1, reduce_bucket_size=100)
    state, _ = bucket_add(init_grad_state(grad_spec([3], 2)), 0, config=config)
    with pytest.raises(GradError, match="(?i)open ipg buckets"):
        micro_step_end(state, config=config)
    state = state._replace(averaged=True)  # at the boundary, bucket 0 still open
    with pytest.raises(GradError, match="(?i)open ipg buckets"):
        optimizer_step(state, config=config)


def test_epilogue_flushes_every_dtype_in_order():
    config = Config(reduce_bucket_size=100)
    state = init_grad_state(grad_spec([3, 4], 1))
    state, _ = bucket_add(state, 0, config=config, dtype="float32")
    state, _ = bucket_add(state, 1, config=config, dtype="bfloat16")
    state, eff = epilogue(state, config=config)
    assert [e.dtype for e in eff if isinstance(e, ReduceBucket)] == ["bfloat16", "float32"]
    assert state.buckets == ()
    assert eff.index(WaitReduce()) > max(i for i, e in enumerate(eff) if isinstance(e, ReduceBucket))


@pytest.mark.parametrize("w, gas, cfg, divisor", [
    (4, 2, {}, 8),  # sums over ranks and micro-steps, divided once
    (4, 2, dict(prescale_gradients=True), 2.0),  # each grad was / W before its reduce: / gas
    (3, 1, dict(prescale_gradients=True), 1.0),
    (2, 2, dict(gradient_predivide_factor=8.0), 0.5),  # / f before, W * gas / f at the boundary
    (3, 3, dict(gradient_predivide_factor=2.0), 4.5),
])
def test_boundary_divisor_undoes_the_predivide(w, gas, cfg, divisor):
    config = Config(gradient_accumulation_steps=gas, **cfg)
    state = init_grad_state(grad_spec([3, 4], w))
    for _ in range(gas):
        state, _ = bucket_add(state, 0, config=config)
        state, _ = epilogue(state, config=config)
        state, eff = micro_step_end(state, config=config)
    assert eff[-1] == AverageGrads(divisor)
    assert isinstance(eff[-1].divisor, int) == (divisor == w * gas)  # an int unless pre-divided


@pytest.mark.parametrize("w, gas, predivide, divisor", [
    (2, 3, 1.0, 6), (4, 2, 4.0, 2.0), (2, 1, 0.5, 4.0), (3, 2, 3.0, 2.0)])
def test_grad_divisor_with_predivide(w, gas, predivide, divisor):
    assert grad_divisor(w, gas, predivide) == divisor


def test_a_skipped_step_closes_the_window_and_counts():
    """optimizer_step(applied=False): the window closes as after a step (micro_step 0, the
    partitions freed), `skipped` counts it and `applied` says it; the next applied step says so."""
    config = Config(gradient_accumulation_steps=1)
    state = init_grad_state(grad_spec([3], 2))
    state, _ = epilogue(state, config=config)
    state, _ = micro_step_end(state, config=config)
    state, eff = optimizer_step(state, config=config, applied=False)
    assert eff == (FreePartitions(),)
    assert (state.micro_step, state.window, state.skipped, state.applied) == (0, 1, 1, False)
    state, _ = epilogue(state, config=config)
    state, _ = micro_step_end(state, config=config)
    state, _ = optimizer_step(state, config=config)
    assert (state.window, state.skipped, state.applied) == (2, 1, True)


def test_without_grad_names_the_trainable_params_no_grad_reached_in_the_window():
    """Frozen params are never named; a param with a grad this window is not; one whose last grad
    was in an earlier window is; a leaf param another rank got a grad for (got_anywhere) is not."""
    config = Config(gradient_accumulation_steps=1, reduce_bucket_size=100)
    state = init_grad_state(grad_spec([3, 4, 5, 6], 2))
    state, _ = bucket_add(state, 1, config=config)
    state, _ = epilogue(state, config=config)
    assert without_grad(state, [True, True, True, False]) == (0, 2)
    assert without_grad(state, [True, True, True, False], frozenset({2})) == (0,)
    state, _ = micro_step_end(state, config=config)
    state, _ = optimizer_step(state, config=config)
    state, _ = bucket_add(state, 0, config=config)
    state, _ = epilogue(state, config=config)
    assert without_grad(state, [True, True, True, True]) == (1, 2, 3)
