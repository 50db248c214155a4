"""A backward holds at most two buckets of grads: the one filling and the one being reduced
(fz3/core/streams.py MAX_REDUCES_IN_FLIGHT; issue #11).

With overlap_comm every reduce is asynchronous; nothing waited for one before the end of the
backward, so every bucket's grads (and its receive scratch) stayed alive to the end: 6 bytes
per param per rank on the GPTs of bench/diagnostics/memory.py. Here, on 2 gloo ranks, a stack of Linear
layers with a bucket of about two layers: at every grad the interpreter has at most one reduce
in flight and holds at most two buckets of grads, on each carrier; the parity suite checks the
numbers.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fz3 import launch

pytestmark = pytest.mark.timeout(240)
LAYER = 32 * 32 + 32
CARRIERS = [{}, {"gloo_reduce_scatter": "native"}, {"reduce_scatter": False}]


def _train_watching(rank: int, widths: list[int], extra: dict, look):
    """A chain of Linear layers (widths[i] -> widths[i + 1]), buckets of about two 32x32 layers,
    `look(engine)` called at every grad; two steps. -> the engine."""
    import fz3
    torch.manual_seed(0)
    net = nn.Sequential(*(nn.Linear(a, b) for a, b in zip(widths, widths[1:])))
    carried = {k: v for k, v in extra.items() if k.startswith("gloo_")}  # fz3.Options' fields
    config = {k: v for k, v in extra.items() if k not in carried}
    engine = fz3.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1),
                            fz3.Config(reduce_bucket_size=2 * LAYER, param_persistence_threshold=0, **config),
                            options=fz3.Options(**carried))
    for p in net.parameters():
        p.register_post_accumulate_grad_hook(lambda _param: look(engine))
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        engine.backward(engine(x[rank * 2:(rank + 1) * 2]).square().mean())
        engine.step()
    return engine


def _run(rank: int, world: int) -> list[dict]:
    out = []
    for extra in CARRIERS:
        seen = {"in_flight": 0, "held": 0, "reduces": 0}

        def look(engine) -> None:
            it = engine.interp
            seen["in_flight"] = max(seen["in_flight"], len(it.reduces))
            held = sum(g.numel() for d in it.held.values() for g in d.values())
            held += sum(b.numel() for b in it.buffers.values())
            seen["held"] = max(seen["held"], held)

        seen["reduces"] = _train_watching(rank, [32] * 13, extra, look).stats()["reduce"]
        out.append(seen)
    return out


def test_at_most_one_reduce_in_flight_and_two_buckets_held():
    for rank, outs in enumerate(launch.run(_run, world_size=2, timeout=200)):
        for extra, seen in zip(CARRIERS, outs):
            assert seen["reduces"] >= 10, (extra, seen)  # several buckets per backward
            assert seen["in_flight"] <= 1, f"rank {rank} {extra}: {seen}"
            assert seen["held"] <= 2 * 2 * LAYER, f"rank {rank} {extra}: {seen}"


def _reduce_buffers(rank: int, world: int) -> list[tuple[int, int]]:
    """Most pooled buffers at once that are not a param's size (a reduce's), and most packed
    groups' staging buffers at once (GROUP_MOST elements each, fz3/interpreters/carriers.py
    P2P.stage), per reduce carrier, over two steps of a stack whose layers (and so buckets)
    differ in size."""
    from fz3.interpreters.messages import GROUP_MOST
    out = []
    for extra in CARRIERS[:2]:
        most = [0, 0]

        def look(engine) -> None:  # the gathers' buffers (all_gather p2p) are one per param
            sizes = {p.numel for p in engine.store.spec.params}
            pooled = engine.interp.buffers_pool.kept()
            most[0] = max(most[0], sum(t.numel() not in sizes and t.numel() != GROUP_MOST for t in pooled))
            most[1] = max(most[1], sum(t.numel() == GROUP_MOST for t in pooled))

        _train_watching(rank, [32, 48, 24, 40, 32, 56, 16, 32, 32], extra, look)
        out.append(tuple(most))
    return out


def test_one_pooled_buffer_serves_every_bucket_size():
    """[Note: one size per reduce buffer] in fz3/interpreters/dist.py: a pooled buffer per bucket
    size stayed in the pool through the backward (300 MiB per rank on the 0.3 B GPT)."""
    for rank, most in enumerate(launch.run(_reduce_buffers, world_size=2, timeout=200)):
        # p2p: the receive scratch; native: the packed input and the output. Staging: a p2p
        # gather's (W, S) rows, and (p2p reduce) the reduce's, one size for all ([Note: packed
        # groups in rows], fz3/interpreters/p2p.py: one buffer where a send and a receive were)
        assert [m[0] for m in most] == [1, 2], f"rank {rank}: pooled reduce buffers at once, per carrier {most}"
        assert [m[1] for m in most] == [2, 1], f"rank {rank}: staging buffers at once, per carrier {most}"
