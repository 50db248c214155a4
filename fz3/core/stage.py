"""ZeRO's stages as values of one policy: what each stage keeps whole and what it partitions.

                 params (compute dtype)        grads                           fp32 masters and
                                                                               optimizer state
    stage 0      whole on every rank           whole in .grad, all-reduced     whole on every rank
                                               at the boundary
    stage 1      whole on every rank           whole in .grad, reduced into    partitioned (1/W)
                                               partitions at the boundary
    stage 2      whole on every rank           partitioned: reduced into       partitioned
                                               partitions every backward
    stage 3      partitioned: gathered per     partitioned                     partitioned
                 module, freed after it

One lifecycle runs every stage; each column is a decision the core already makes, and the
stage picks its value:
- params whole = every param persistent ([Note: persistent params stay live],
  fz3/core/param/hold.py): gathered once, kept, refreshed by one gather after each optimizer
  step (the all-gather of the updated params DeepSpeed's stages 1 and 2 run). `persistence`.
- grads at the boundary = a grad is not reduced when autograd accumulates it: it waits in
  param.grad, where the next backward adds to it, and the step() that closes the window
  reduces every waiting grad at once (fz3/core/grad/grads.py, [Note: grads at the boundary]).
  DeepSpeed's stages 0 and 1 reduce in the boundary's backward, after the micro-steps before
  it accumulated locally; 2 and 3 reduce in every backward (IPG buckets).
- optimizer whole = the layout of one rank: every rank's shard is the whole param, and the
  reduce keeps the whole mean grad (`layout_world`).
Memory per param per rank, W ranks, AdamW, fp32 compute (bf16 / fp16: params and grads 2 bytes,
masters 4 beside them): stage 0 16 bytes; 1: 4 + 4 + 8/W (grads whole through the window); 2:
4 + 4/W + 8/W; 3: 16/W plus what is gathered (bench/RESULTS.md has the measured table beside
DeepSpeed's).
DeepSpeed: runtime/zero/stage_1_and_2.py (stages 1, 2; `partition_gradients` is stage >= 2),
stage3.py, and the engine's own data parallel at stage 0 (engine.py allreduce_gradients).
"""
from __future__ import annotations

import sys
from typing import NamedTuple, Optional

from fz3.config.config import Config


class Policy(NamedTuple):
    params_whole: bool  # every param stays gathered (persistent)
    grads_at_boundary: bool  # grads wait in param.grad and are reduced at the boundary's step()
    optimizer_whole: bool  # masters and optimizer state whole on every rank (layout of one rank)


STAGES = {
    0: Policy(params_whole=True, grads_at_boundary=True, optimizer_whole=True),
    1: Policy(params_whole=True, grads_at_boundary=True, optimizer_whole=False),
    2: Policy(params_whole=True, grads_at_boundary=False, optimizer_whole=False),
    3: Policy(params_whole=False, grads_at_boundary=False, optimizer_whole=False),
}


def policy(config: Config) -> Policy:
    return STAGES[config.stage]


def persistence(config: Config) -> tuple[int, Optional[int]]:
    """(param_persistence_threshold, model_persistence_threshold) as build_spec takes them:
    every param at stages 0-2, the config's at stage 3."""
    if policy(config).params_whole:
        return sys.maxsize, None
    return config.param_persistence_threshold, config.model_persistence_threshold


def layout_world(config: Config, world_size: int) -> int:
    """The ranks a param is split over: 1 where the optimizer is whole (stage 0), a group of
    `shard_group_size` under hybrid sharding, else all ([Note: hybrid sharding])."""
    if policy(config).optimizer_whole:
        return 1
    S = config.shard_group_size
    if not S or S == world_size:
        return world_size
    if world_size % S:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(f"Config.shard_group_size={S} does not divide the world of {world_size} ranks: the world "
                         f"is shard_group_size x replica groups, so use one of {divisors} (0: flat, one group of all)")
    return S


def secondary_world(config: Config, world_size: int) -> int:
    """hpZ's group size H: the ranks a param's secondary shard is split over ([Note: hpZ]); 1
    when off, or when H is the whole shard group (the secondary would be the shard itself)."""
    H = config.zero_hpz_partition_size
    if H == 1:
        return 1
    S = layout_world(config, world_size)
    where = (f"the shard group of Config.shard_group_size={S}" if S < world_size else
             f"the world of {world_size} ranks (flat ZeRO-3: params are sharded over all of them)")
    if H > S:
        raise ValueError(f"Config.zero_hpz_partition_size={H} is larger than the shard group: a secondary shard "
                         f"is cut within {where}, so use a divisor of {S} (1: off)")
    if S % H:
        divisors = [d for d in range(1, S + 1) if S % d == 0]
        raise ValueError(f"Config.zero_hpz_partition_size={H} does not divide {where}: use one of {divisors} "
                         "(1: off)")
    return 1 if H == S else H


# [Note: hybrid sharding] With shard_group_size S < W (FSDP2's HSDP), the ranks form R = W / S
# groups of S consecutive ranks (group g: ranks g*S .. g*S + S - 1; a node under torchrun). A
# param's layout is over its group: rank r holds shard r % S, the same bytes as rank r % S of
# every other group, so the spec's world_size is S and its replicas R. Gathers move bytes only
# within the group. A grad is reduced within the group (the bucket's reduce-scatter, or its
# all-reduce on the allreduce path), then its partition across the R groups, one all-reduce
# over the ranks that hold the same shard (ReduceBucket.across): each element once per axis.
# The mean divides by all W ranks (spec.ranks). Everything that must agree world-wide does:
# the divergence check's descriptors go to every rank, and the grad norm is the first group's,
# read by every rank alike (after the all-reduce across, every group's partitions are equal).
# Checkpoints are written by the first group (one copy of each shard), in the layout of S ranks,
# and load under any other. DeepSpeed 0.19.8 removed its hybrid mode (MiCS).

# [Note: hpZ] ZeRO++'s hierarchical partitioning (DeepSpeed's zero_hpz_partition_size H): the
# ranks form groups of H consecutive ranks (a node), within the shard group. When a forward's
# release frees a param whose backward gathers it again (a Free marked `refetch`), each rank
# first keeps a secondary shard, its 1/H of the full value (rank r: piece r % H, the layout of
# H ranks); the backward's gather of that param then collects the H secondary shards within
# the hpZ group (AllGather.secondary), never crossing to another node. The forward's gathers
# stay on the shard group (DeepSpeed: `not forward`). The shards stay the primary copy: grads,
# masters and the optimizer are unchanged, and only the gathers of the backward move. A
# secondary shard lives until the params change: the optimizer step, new shards (a checkpoint
# load) or a stale gathered_parameters drops it (DropSecondary), and the next forward keeps a
# fresh one; a micro-step within the window reuses it. Memory: 1/H of every param the forward
# frees, in the compute dtype, from the forward to the step (the plan's peak_secondary_bytes).
# H equal to the shard group gives the shard itself: off. DeepSpeed: partition_parameters.py
# _partition_param_sec, all_gather_coalesced (ds_secondary_tensor), invalidate_secondary_tensor.
