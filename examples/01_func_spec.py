"""01 - fz3.func: a whole ZeRO-3 training step as one pure function, equal to single-process
training bit for bit.

What it shows, in numbered steps (each runnable alone):
  1. the shard layout: a 7-element param on 3 ranks (ceil, padding, a rank may own padding)
  2. one ZeRO-3 step on 3 simulated ranks (gather -> vmap(grad) -> reduce -> SGD on fp32
     shards) against plain single-process training: torch.equal
  3. the table: world sizes 1-4 x gradient accumulation 1-3, three optimizer steps each, both
     reduce paths: every param equal, bit for bit
  4. the control plane on the same grads: bucket_add / epilogue effects, run by the simulated
     world, give the same grad partitions as fz3.func

Why exact: small-integer params and data, lr = 2**-5 and a per-sample SUM loss scaled by
W * gas keep every value a short dyadic rational, so summation order cannot change a bit
(see [Note: exactness] in fz3/func.py).

Run:  .venv/bin/python examples/01_func_spec.py        # all steps
      .venv/bin/python examples/01_func_spec.py 3      # one step
"""
import sys

import torch
from torch import nn

from fz3 import func
from fz3.config.config import Config
from fz3.core.grad.epilogue import epilogue, micro_step_end
from fz3.core.grad.grads import bucket_add, init_grad_state
from fz3.core.spec import build_spec
from fz3.data import layout
from fz3.interpreters.simulated import SimulatedWorld

LR = 2.0 ** -5


def problem(world_size, gas, steps=3, seed=0):
    """A 2-layer MLP (numels 35, 7, 21, 3), integer params and data, (W, B=2, ...) batches."""
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    params = {n: torch.randint(-2, 3, p.shape, generator=g).float()
              for n, p in model.named_parameters()}
    data = [[(torch.randint(-2, 3, (world_size, 2, 5), generator=g).float(),
              torch.randint(-2, 3, (world_size, 2, 3), generator=g).float())
             for _ in range(gas)] for _ in range(steps)]
    scale = world_size * gas
    return model, params, data, lambda out, y: scale * (out * y).sum()


def train_both(world_size, gas, path="reduce_scatter"):
    """Three optimizer steps with fz3.func and with the reference -> (fz3 params, reference)."""
    model, params, data, loss = problem(world_size, gas)
    shards, ref = func.shard_params(params, world_size), params
    for micro in data:
        shards, _ = func.train_step(model, shards, micro, loss_fn=loss, lr=LR, path=path)
        ref, _ = func.reference_step(model, ref, micro, loss_fn=loss, lr=LR)
    return func.unshard_params(shards, {n: p.shape for n, p in params.items()}), ref


def step1():
    print("1. shard layout: 7 elements on 3 ranks -> shard = ceil(7/3) = 3, 2 zeros of padding")
    full = torch.arange(1.0, 8)
    for r, row in enumerate(layout.shard(full, 3)):
        print(f"   rank {r} owns {row.tolist()}")
    print(f"   unshard -> {layout.unshard(layout.shard(full, 3), (7,)).tolist()}")


def step2():
    print("2. one ZeRO-3 step on 3 ranks, 2 micro-steps, vs single-process training")
    model, params, data, loss = problem(3, 2, steps=1)
    shards, _ = func.train_step(model, func.shard_params(params, 3), data[0], loss_fn=loss, lr=LR)
    ref, _ = func.reference_step(model, params, data[0], loss_fn=loss, lr=LR)
    full = func.unshard_params(shards, {n: p.shape for n, p in params.items()})
    for n in params:
        diff = (full[n] - ref[n]).abs().max().item()
        print(f"   {n:9s} shards {str(tuple(shards[n].shape)):8s} max |diff| {diff:.1e}  "
              f"torch.equal {torch.equal(full[n], ref[n])}")


def step3():
    print("3. three optimizer steps, both reduce paths: torch.equal(fz3.func, reference)")
    print("   W \\ gas     1     2     3")
    for w in range(1, 5):
        row = []
        for gas in range(1, 4):
            ok = all(all(torch.equal(a[n], b[n]) for n in a)
                     for a, b in (train_both(w, gas, p) for p in ("reduce_scatter", "allreduce")))
            row.append(f"{str(ok):>5s}")
        print(f"   {w}       {' '.join(row)}")


def step4():
    print("4. the core on the same grads: W=2, bucket of 30 elements, all-reduce path")
    model, params, data, loss = problem(2, 1, steps=1)
    names = list(params)
    spec = build_spec([(n, params[n].numel()) for n in names], [("mlp", range(4), False)],
                      world_size=2, persistence_threshold=0)
    config = Config(reduce_bucket_size=30, reduce_scatter=False, overlap_comm=True)
    state, world = init_grad_state(spec), SimulatedWorld(spec, config=config)
    full = func.gather_params(func.shard_params(params, 2), {n: p.shape for n, p in params.items()},
                              torch.float32)
    grads = func.rank_grads(model, full, data[0][0], loss)
    for p in reversed(range(4)):  # autograd reports the last layer first
        world.accumulate_grad(p, list(grads[names[p]]))
        state, eff = bucket_add(state, p, config=config)
        print(f"   bucket_add({names[p]}) -> {[type(e).__name__ for e in eff]}")
        world.run(eff)
    state, eff = epilogue(state, config=config)
    print(f"   epilogue -> {[type(e).__name__ for e in eff]}")
    world.run(eff)
    state, eff = micro_step_end(state, config=config)  # engine.step(): the boundary averages
    print(f"   step() -> {[type(e).__name__ for e in eff]}")
    world.run(eff)
    _, mean = func.train_step(model, func.shard_params(params, 2), data[0], loss_fn=loss, lr=LR)
    same = all(torch.equal(world.partitions[r][p], mean[n][r]) for p, n in enumerate(names)
               for r in range(2))
    print(f"   partitions equal fz3.func's mean grads: {same}")


if __name__ == "__main__":
    steps = [step1, step2, step3, step4]
    for i in ([int(sys.argv[1])] if len(sys.argv) > 1 else range(1, 5)):
        steps[i - 1]()
