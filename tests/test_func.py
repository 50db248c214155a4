"""fz3.func: the functional ZeRO-3 step equals single-process training, bit for bit (I7).

A 2-layer MLP with numels 35, 7, 21, 3 (none divisible by 2 or 4; only 21 and 3 by 3), small
integer params and data, lr = 2**-5, and a linear per-sample SUM loss scaled by W * gas so the
one division by W * gas is exact (see [Note: exactness] in fz3/func.py). Every case also checks
that an fp64 reference gives the same bits, so the equality is not luck.
"""
import itertools

import pytest
import torch
from torch import nn

from fz3 import func
from fz3.config.config import Config
from fz3.core.grad.epilogue import epilogue, micro_step_end
from fz3.core.grad.grads import bucket_add, init_grad_state
from fz3.core.spec import build_spec
from fz3.interpreters.simulated import SimulatedWorld

LR = 2.0 ** -5
STEPS = 3


def problem(seed, world_size, gas, batch=2):
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    params = {n: torch.randint(-2, 3, p.shape, generator=g).float()
              for n, p in model.named_parameters()}
    steps = [[(torch.randint(-2, 3, (world_size, batch, 5), generator=g).float(),
               torch.randint(-2, 3, (world_size, batch, 3), generator=g).float())
              for _ in range(gas)] for _ in range(STEPS)]
    scale = world_size * gas
    return model, params, steps, lambda out, y: scale * (out * y).sum()


@pytest.mark.parametrize("world_size, gas", list(itertools.product(range(1, 5), range(1, 4))))
def test_train_step_equals_single_process_training(world_size, gas):
    model, params, steps, loss = problem(world_size * 10 + gas, world_size, gas)
    shapes = {n: p.shape for n, p in params.items()}
    shards = func.shard_params(params, world_size)
    ref, ref64 = params, {n: p.double() for n, p in params.items()}
    for micro in steps:
        new = {}
        for path in ("reduce_scatter", "allreduce"):
            new[path], mean = func.train_step(model, shards, micro, loss_fn=loss, lr=LR, path=path)
        assert all(torch.equal(new["allreduce"][n], new["reduce_scatter"][n]) for n in shapes)
        shards = new["reduce_scatter"]
        ref, ref_mean = func.reference_step(model, ref, micro, loss_fn=loss, lr=LR)
        ref64, _ = func.reference_step(model.double(), ref64,
                                       [(x.double(), y.double()) for x, y in micro],
                                       loss_fn=loss, lr=LR)
        model.float()
        full = func.unshard_params(shards, shapes)
        for n in shapes:
            assert torch.equal(full[n], ref[n]), n
            assert torch.equal(ref64[n], ref[n].double()), f"{n}: fp32 rounded; not exact data"
            assert torch.equal(func.unshard_params({n: mean[n]}, shapes)[n], ref_mean[n]), n
        assert shards["0.weight"].dtype == torch.float32 and shards["0.weight"].shape[0] == world_size
    assert any(not torch.equal(ref[n], params[n]) for n in shapes)  # it did train


def test_one_step_is_exact_without_the_loss_scale():
    # a single step: grads are exact integers, and both sides divide the same sum once
    model, params, steps, _ = problem(7, 3, 2)
    loss = lambda out, y: (out * y).sum()  # noqa: E731
    shards, _ = func.train_step(model, func.shard_params(params, 3), steps[0], loss_fn=loss, lr=LR)
    ref, _ = func.reference_step(model, params, steps[0], loss_fn=loss, lr=LR)
    full = func.unshard_params(shards, {n: p.shape for n, p in params.items()})
    assert all(torch.equal(full[n], ref[n]) for n in ref)


@pytest.mark.parametrize("world_size, gas, bucket, reduce_scatter",
                         [(2, 1, 10, True), (3, 2, 30, False), (4, 3, 1, True), (1, 2, 40, False)])
def test_core_and_simulated_world_reproduce_the_spec(world_size, gas, bucket, reduce_scatter):
    """The oracle for the shell: bucket_add/epilogue on SimulatedWorld give func's partitions."""
    model, params, steps, loss = problem(3, world_size, gas)
    names = list(params)
    spec = build_spec([(n, params[n].numel()) for n in names], [("root", range(len(names)), False)],
                      world_size=world_size, persistence_threshold=0)
    config = Config(reduce_bucket_size=bucket, reduce_scatter=reduce_scatter,
                    gradient_accumulation_steps=gas)
    state, world = init_grad_state(spec), SimulatedWorld(spec, config=config)
    full = func.gather_params(func.shard_params(params, world_size),
                              {n: p.shape for n, p in params.items()}, torch.float32)
    for batch in steps[0]:
        grads = func.rank_grads(model, full, batch, loss)
        for p in reversed(range(len(names))):  # backward reports grads last layer first
            world.accumulate_grad(p, list(grads[names[p]]))
            state, eff = bucket_add(state, p, config=config)
            world.run(eff)
        state, eff = epilogue(state, config=config)
        world.run(eff)
        state, eff = micro_step_end(state, config=config)  # the loop's step()
        world.run(eff)
    _, mean = func.train_step(model, func.shard_params(params, world_size), steps[0],
                              loss_fn=loss, lr=LR)
    for p, n in enumerate(names):
        for r in range(world_size):
            assert torch.equal(world.partitions[r][p], mean[n][r]), (n, r)


def test_bf16_compute_keeps_fp32_master_shards():
    model, params, steps, loss = problem(5, 2, 2)
    out = {}
    for dt in (torch.float32, torch.bfloat16):
        shards, mean = func.train_step(model, func.shard_params(params, 2), steps[0], loss_fn=loss,
                                       lr=LR, compute_dtype=dt)
        assert all(t.dtype == torch.float32 for t in (*shards.values(), *mean.values()))
        out[dt] = shards
    for n in params:  # bf16 rounds the grads (8-bit mantissa) but lands close
        assert torch.allclose(out[torch.bfloat16][n], out[torch.float32][n], rtol=0, atol=0.5), n


def test_empty_micro_batches_rejected():
    model, params, _, loss = problem(0, 1, 1)
    with pytest.raises(ValueError, match="at least one micro-batch"):
        func.train_step(model, func.shard_params(params, 1), [], loss_fn=loss, lr=LR)
