"""Step 3: the gradient lifecycle, from grads to averaged partitions, on a simulated world.

No processes: the pure gradient core (fz3.core.grad.grads, fz3.core.grad.epilogue) decides, and a
simulated world of 2 ranks in this process carries out its effects on real tensors. Four
params' grads arrive in backward order, two micro-steps per optimizer step (gradient
accumulation), once with each reduce path. Watch:

  - the IPG bucket: grads are copied in until the next one would overflow reduce_bucket_size,
    then the bucket is reduced (ReduceBucket) and each rank keeps its partition (WritePartition);
    a grad larger than the whole bucket is reduced on its own;
  - copy, then add: a partition's first write in the window is a copy, later micro-steps add;
  - the boundary: ZeroPartitions for params no grad reached, then one AverageGrads by
    world size x micro-steps; the partitions equal the mean gradient's slices exactly;
  - FreePartitions after the optimizer step: the partitions' memory goes back (NaN here).

    python examples/03_grad_buckets.py
"""
import torch

from fz3 import Config
from fz3.core.grad import epilogue as ep
from fz3.core.grad.grads import bucket_add, init_grad_state
from fz3.core.spec import build_spec
from fz3.interpreters.simulated import SimulatedWorld

W, GAS = 2, 2
PARAMS = [("emb", 6), ("attn", 5), ("mlp", 12), ("unused", 3)]  # "unused" never gets a grad
ARRIVALS = [2, 1, 0]  # backward order: the last module's params first


def grads_of(step: int, micro: int, p: int, rank: int) -> torch.Tensor:
    """Small integers, different per rank and micro-step, so every sum is exact."""
    n = PARAMS[p][1]
    return torch.arange(n, dtype=torch.float32) + 10 * p + 100 * micro + 1000 * rank + step


def show(event: str, effects) -> None:
    print(f"  {event}")
    for e in effects:
        print(f"      {e}")


for path, reduce_scatter in (("reduce_scatter", True), ("all-reduce", False)):
    config = Config(reduce_bucket_size=11, gradient_accumulation_steps=GAS,
                    reduce_scatter=reduce_scatter, overlap_comm=False)
    spec = build_spec(PARAMS, [("", list(range(len(PARAMS))), False)], world_size=W,
                      persistence_threshold=0)
    world = SimulatedWorld(spec, config=config)
    state = init_grad_state(spec)
    print(f"\n== reduce path: {path}, reduce_bucket_size {config.reduce_bucket_size}, "
          f"{W} ranks, {GAS} micro-steps per optimizer step")
    for micro in range(GAS):
        print(f" micro-step {micro}")
        for p in ARRIVALS:
            world.accumulate_grad(p, [grads_of(0, micro, p, r) for r in range(W)])  # autograd
            state, effects = bucket_add(state, p, config=config)
            world.run(effects)
            show(f"grad of {PARAMS[p][0]} ({PARAMS[p][1]} elements) ready -> bucket_add", effects)
        state, effects = ep.epilogue(state, config=config)
        world.run(effects)
        show("end of backward -> epilogue", effects)
        state, effects = ep.micro_step_end(state, config=config)
        world.run(effects)
        show("engine.step() -> micro_step_end (the last one closes the window)", effects)
    print(" partitions at the boundary (rank: param -> values), against the mean gradient:")
    for p, (name, n) in enumerate(PARAMS):
        mean = sum(grads_of(0, m, p, r) for m in range(GAS) for r in range(W)) / (W * GAS) \
            if p in ARRIVALS else torch.zeros(n)
        s = spec.params[p].shard_numel
        padded = torch.cat([mean, torch.zeros(s * W - n)])
        for r in range(W):
            got = world.partitions[r][p]
            assert torch.equal(got, padded[r * s:(r + 1) * s]), (path, name, r)
            print(f"    rank {r}: {name:6s} -> {got.tolist()}")
    print("    every partition equals its slice of the mean gradient, bit for bit")
    state, effects = ep.optimizer_step(state, config=config)
    world.run(effects)
    show("optimizer step -> optimizer_step", effects)
    print(f"    rank 0's partitions now: {[t.tolist() for t in world.partitions[0]][:2]} ... "
          "(memory given back; the next window's first write is a copy)")
