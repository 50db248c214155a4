"""Drawn nets (tests/support/drawn_nets.py) trained on thread ranks under a Shadow
(tests/support/shadow.py): the setups drawn, one rank's training, and the whole differential run.
Used by property_tests/test_interpreters_differential.py."""
from __future__ import annotations

import torch
from hypothesis import strategies as st

from tests.support.shadow import Shadow
from tests.support import drawn_nets as dn


@st.composite
def setups(draw) -> tuple[int, dict, dict]:
    """(world size, Config fields, Options fields): 2 or 3 ranks, any carrier for each collective.

    [Note: exact reduces] Bitwise equality needs each reduce to give the same bits whatever the
    order of its sum: the shadow sums with torch.sum, the thread transport rank after rank,
    the p2p carrier its own partition first (rank 2 of 3 adds x2 + x0 + x1). Two ranks: one
    addition, rounded once in any order, whatever the values. Three ranks: only while every
    partial sum is exact. drawn_nets' fp32 values are integers far below 2^24 through the first
    window; its update divides by 3 or 6, so a second window's grads are not (tried: 5 of 200
    drawn 3-rank cases over two windows differed in the last bits, on rank 2 under p2p). bf16
    holds integers exactly only up to 256, and nothing bounds the nets' grads below it (the
    largest in 300 draws was 122: a 3-rank sum can pass 256), so bf16 compute and a bf16 comm
    dtype are drawn on 2 ranks only; 3 ranks run one window (`run_differential`)."""
    world = draw(st.sampled_from([2, 3]))
    contiguous = draw(st.booleans())
    dtype = draw(st.sampled_from(["fp32", "bf16"])) if world == 2 else "fp32"
    comm = draw(st.sampled_from([None, "fp32"] + (["bf16"] if world == 2 else [])))
    config = dict(param_persistence_threshold=draw(st.sampled_from([0, 5, 10**5])),
                  prefetch_bucket_size=draw(dn.SIZES), max_live_parameters=draw(st.sampled_from([0, 20, 10**9])),
                  max_reuse_distance=draw(dn.SIZES), reduce_bucket_size=draw(st.sampled_from([1, 16, 100, 10**9])),
                  overlap_comm=draw(st.booleans()), gradient_accumulation_steps=draw(st.sampled_from([1, 2])),
                  contiguous_gradients=contiguous, reduce_scatter=not contiguous or draw(st.booleans()),
                  compute_dtype=dtype, communication_data_type=comm,
                  gradient_predivide_factor=draw(st.sampled_from([1.0, 2.0])))
    carriers = st.sampled_from(["p2p", "all_reduce", "native"])
    return world, config, dict(gloo_all_gather=draw(carriers), gloo_reduce_scatter=draw(carriers))


def train_shadowed(rank: int, world: int, spec: dn.NetSpec, config: dict, options: dict, shadow: Shadow,
                   windows: int) -> None:
    """One thread rank: `windows` accumulation windows, each ending in an optimizer step, then
    a forward without grad (the refreshed shards gathered), every effect shadowed."""
    import fz3
    net = dn.Net(spec)
    if dn.leaf_classes(spec):
        fz3.set_leaf_modules(net, dn.leaf_classes(spec))
    engine = fz3.initialize(net, torch.optim.SGD(net.parameters(), lr=dn.LR), fz3.Config(**config),
                            options=fz3.Options(**options))
    shadow.attach(engine)
    steps = windows * config.get("gradient_accumulation_steps", 1)
    for i in range(steps):
        engine.backward(engine(dn.rank_rows(dn.batch(spec, i, world), rank)).sum())
        engine.step()
    with torch.no_grad():
        engine(dn.rank_rows(dn.batch(spec, steps, world), rank))


def run_differential(spec: dn.NetSpec, world: int, config: dict, options: dict) -> dict:
    """Train `spec` on `world` thread ranks under a shadow; Mismatch at the first difference.
    -> what was checked: effects run, full params and partitions compared."""
    from fz3 import launch
    shadow = Shadow(world)
    windows = 2 if world == 2 else 1  # [Note: exact reduces]
    try:
        launch.run_threads(train_shadowed, world, args=(spec, config, options, shadow, windows), timeout_s=120)
    except RuntimeError:
        if shadow.failure is not None:
            raise shadow.failure from None
        raise
    return shadow.finish()
