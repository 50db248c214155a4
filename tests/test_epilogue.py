"""fz3.core.grad.epilogue: end of a backward, accumulation boundary, optimizer_step reset."""
import pytest

from fz3.config.config import Config
from fz3.core.effects import AverageGrads, FreePartitions, ReduceBucket, WaitReduce, ZeroPartitions
from fz3.core.grad.epilogue import at_boundary, epilogue, grad_divisor, never_written, optimizer_step, without_grad
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
    # one micro-step: flush, wait, zero p1 (never reported), average by W
    (2, 1, True, [[0]], [["ReduceBucket", "WritePartition", "DropGrads", "WaitReduce",
                          "ZeroPartitions", "AverageGrads"]]),
    # no overlap_comm: nothing to wait for
    (3, 1, False, [[0, 1]], [["ReduceBucket", "WritePartition", "WritePartition", "DropGrads",
                              "AverageGrads"]]),
    # two micro-steps: the first only flushes and waits; p1 first written at micro-step 1
    (4, 2, True, [[0], [1, 0]], [["ReduceBucket", "WritePartition", "DropGrads", "WaitReduce"],
                                 ["ReduceBucket", "WritePartition", "WritePartition", "DropGrads",
                                  "WaitReduce", "AverageGrads"]]),
    # an empty backward still counts as a micro-step
    (1, 2, True, [[], []], [["WaitReduce"], ["WaitReduce", "ZeroPartitions", "AverageGrads"]]),
])
def test_epilogue_effects(world_size, gas, overlap, reports, expected):
    config = Config(gradient_accumulation_steps=gas, overlap_comm=overlap)
    state = init_grad_state(grad_spec([3, 4], world_size))
    for m, (ps, want) in enumerate(zip(reports, expected)):
        for p in ps:
            state, _ = bucket_add(state, p, config=config)
        state, eff = epilogue(state, config=config)
        check_drained(state, eff, config=config)
        assert kinds(eff) == want
        assert state.micro_step == m + 1 and state.backward == m + 1
    assert at_boundary(state, config=config)
    assert eff[-1] == AverageGrads(world_size * gas)
    written = {p for ps in reports for p in ps}
    zero = [e for e in eff if isinstance(e, ZeroPartitions)]
    assert (zero[0].params if zero else ()) == tuple(p for p in (0, 1) if p not in written)


@pytest.mark.parametrize("w, gas", [(1, 1), (2, 3), (4, 4), (3, 1)])
def test_divisor_is_world_size_times_accumulation_steps(w, gas):
    assert grad_divisor(w, gas) == w * gas


def test_window_lifecycle_and_errors():
    config = Config(gradient_accumulation_steps=2)
    state = init_grad_state(grad_spec([3], 2))
    with pytest.raises(GradError, match="after 0 of 2 micro-steps"):
        optimizer_step(state, config=config)
    state, _ = epilogue(state, config=config)
    state, _ = epilogue(state, config=config)
    with pytest.raises(GradError, match="window is complete"):
        epilogue(state, config=config)
    with pytest.raises(GradError, match="window is complete"):
        bucket_add(state, 0, config=config)
    state, eff = optimizer_step(state, config=config)
    assert eff == (FreePartitions(),) and state.micro_step == 0 and state.window == 1  # memory back
    assert never_written(state) == (0,)  # a new window: nothing written yet


def test_optimizer_step_refuses_open_buckets_and_says_why():
    """optimizer_step at the boundary with an IPG bucket still open is refused, and the error says
    so. The transitions never leave one open there (the epilogue flushes before micro_step
    reaches gas, bucket_add refuses a complete window), so the state is made by hand."""
    config = Config(gradient_accumulation_steps=1, reduce_bucket_size=100)
    state, _ = bucket_add(init_grad_state(grad_spec([3], 2)), 0, config=config)
    state = state._replace(micro_step=1)  # at the boundary, bucket 0 still open
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
        state, eff = epilogue(state, config=config)
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
    state, eff = optimizer_step(state, config=config, applied=False)
    assert eff == (FreePartitions(),)
    assert (state.micro_step, state.window, state.skipped, state.applied) == (0, 1, 1, False)
    state, _ = epilogue(state, config=config)
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
    state, _ = optimizer_step(state, config=config)
    state, _ = bucket_add(state, 0, config=config)
    state, _ = epilogue(state, config=config)
    assert without_grad(state, [True, True, True, True]) == (1, 2, 3)
