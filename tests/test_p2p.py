"""fz3/interpreters/p2p.py: all-gather and reduce-scatter from point-to-point sends, on 2 and 3
gloo ranks, against the layout's definition of shards and partitions (fz3.data.layout).

Sizes cover the padding cases: numel 0, numel < W (a rank holds padding only), numel not a
multiple of W, an even split, and one large param (megabytes per message). Two operations are
in flight at once, so messages under different tags must not mix. Each runs with every param its
own message and with the small ones packed (fz3.interpreters.messages), in one group or several.
"""
from __future__ import annotations

import pytest
import torch

from fz3.interpreters import messages
from fz3.data import layout
from fz3.data.layout import rank_span
from fz3.interpreters import accounting, p2p
from fz3.interpreters.transport import TorchTransport
from fz3.launch import run

pytestmark = pytest.mark.timeout(120)

NUMELS = [0, 1, 2, 600_001, 5, 7, 12]


def _full(i: int, n: int, rank: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Param i's value (rank -1) or rank's grad of it: distinct per param and rank, small
    integers, so bf16 holds them and their sums exactly."""
    return (torch.arange(n) % 20 + 10 * i + rank + 2).to(dtype)


GROUPINGS = {"alone": None, "packed": messages.groups(NUMELS, small=16),
             "split": messages.groups(NUMELS, small=16, most=10)}


class Counting(TorchTransport):
    """torch.distributed, counting the sends posted."""

    sends = 0

    def isend(self, t, dst, tag):
        Counting.sends += 1
        return super().isend(t, dst, tag)


def _worker(rank: int, world: int, dtype: torch.dtype, grouping: str) -> dict:
    shards = [layout.shard_of(_full(i, n, -1, dtype), rank, world) for i, n in enumerate(NUMELS)]
    fulls_a = [torch.full((n,), float("nan"), dtype=dtype) for n in NUMELS]
    fulls_b = [torch.full((n,), float("nan"), dtype=dtype) for n in NUMELS]
    grads = [_full(i, n, rank, dtype) for i, n in enumerate(NUMELS)]
    before = [g.clone() for g in grads]
    groups = GROUPINGS[grouping]
    # packed groups travel as padded rows ([Note: packed groups in rows]): the layout says how much
    numel = p2p.ReduceLayout(NUMELS, rank, world, groups).scratch_numel if groups else \
        p2p.scratch_numel(NUMELS, rank, world)
    scratch = torch.full((numel,), float("nan"), dtype=dtype)
    a = p2p.all_gather(fulls_a, shards, Counting(), tag=1, groups=groups)
    rs, result = p2p.reduce_scatter(grads, scratch, Counting(), tag=2, groups=groups)
    b = p2p.all_gather(fulls_b, shards, Counting(), tag=3, groups=groups)
    fulls_c = None
    if groups:  # a gather by rows, into buffers padded to W * s_i ([Note: packed groups in rows])
        plan = p2p.GatherPlan(NUMELS, rank, world, groups)
        bufs = [torch.full((n,), float("nan"), dtype=dtype) for n in p2p.padded_numels(NUMELS, world, plan)]
        fulls_c = [buf[:n] for buf, n in zip(bufs, NUMELS)]
        c = p2p.all_gather(fulls_c, shards, Counting(), tag=4, groups=groups,
                           layout=p2p.GatherLayout(fulls_c, rank, world, groups, plan, padded=bufs))
    for w in (b, rs, a) + ((c,) if groups else ()):  # waited out of issue order
        w.wait()
    return {"gathered": fulls_a, "gathered_again": fulls_b, "by_rows": fulls_c, "reduced": result(),
            "grads": grads, "before": before, "sends": Counting.sends}


def _sends(groups, world: int, rank: int) -> int:
    """Sends of the three operations, as fz3.plan counts them (accounting.p2p_sends)."""
    return (2 * accounting.p2p_sends(NUMELS, groups, rank, world, gather=True)
            + accounting.p2p_sends(NUMELS, groups, rank, world, gather=False))


@pytest.mark.parametrize("world,dtype,grouping", [(2, torch.float32, "alone"), (3, torch.float32, "alone"),
                                                  (2, torch.bfloat16, "alone"), (2, torch.float32, "packed"),
                                                  (3, torch.float32, "split"), (2, torch.bfloat16, "packed")])
def test_p2p_gather_and_reduce_scatter_match_the_layout(world, dtype, grouping):
    out = run(_worker, world_size=world, args=(dtype, grouping), timeout=90)
    groups = GROUPINGS[grouping] or tuple((i,) for i in range(len(NUMELS)))
    for rank, res in enumerate(out):
        by_rows = accounting.p2p_sends(NUMELS, groups, rank, world, gather=True) if res["by_rows"] else 0
        assert res["sends"] == _sends(groups, world, rank) + by_rows, rank
        for i, n in enumerate(NUMELS):
            want = _full(i, n, -1, dtype)
            assert torch.equal(res["gathered"][i], want), (rank, n)
            assert torch.equal(res["gathered_again"][i], want), (rank, n)
            if res["by_rows"]:
                assert torch.equal(res["by_rows"][i], want), (rank, n)
            total = sum(_full(i, n, r, dtype) for r in range(world))
            part = layout.rank_slice(total, rank, world)
            assert res["reduced"][i].shape == part.shape, (rank, n)
            torch.testing.assert_close(res["reduced"][i], part, rtol=0, atol=0)
            lo, hi = rank_span(n, rank, world)  # only the own partition was written
            outside = torch.ones(n, dtype=torch.bool)
            outside[lo:hi] = False
            assert torch.equal(res["grads"][i][outside], res["before"][i][outside]), (rank, n)


def test_span_and_scratch_numel():
    assert [rank_span(7, r, 3) for r in range(3)] == [(0, 3), (3, 6), (6, 7)]
    assert [rank_span(1, r, 3) for r in range(3)] == [(0, 1), (1, 1), (1, 1)]
    assert [rank_span(0, r, 2) for r in range(2)] == [(0, 0), (0, 0)]
    assert p2p.scratch_numel([7, 1, 0], 0, 3) == 2 * (3 + 1)
    assert p2p.scratch_numel([7, 1, 0], 2, 3) == 2 * 1
    for rank in range(3):  # the reduce's layout receives as much with every param alone ...
        layout = p2p.ReduceLayout([7, 1, 0], rank, 3, ((0,), (1,), (2,)))
        assert layout.scratch_numel == p2p.scratch_numel([7, 1, 0], rank, 3), rank
    # ... and a packed group's padded row from each peer, where this rank holds an element of one
    # of its params: shards of 3 and 1 ([Note: packed groups in rows]); only rank 0 holds p1's
    for groups, want in ((((0, 1, 2),), [8, 8, 8]), (((1, 2), (0,)), [2 * (1 + 3), 2 * 3, 2 * 1])):
        assert [p2p.ReduceLayout([7, 1, 0], r, 3, groups).scratch_numel for r in range(3)] == want, groups


def _subgroup_worker(rank: int, world: int) -> dict | None:
    import torch.distributed as dist
    group = dist.new_group([0, 2])  # every rank creates it; ranks 0 and 2 are its ranks 0 and 1
    if rank == 1:
        return None
    me = dist.get_rank(group)
    shards = [layout.shard_of(_full(i, n, -1), me, 2) for i, n in enumerate(NUMELS)]
    fulls = [torch.full((n,), float("nan")) for n in NUMELS]
    grads = [_full(i, n, me) for i, n in enumerate(NUMELS)]
    scratch = torch.empty(p2p.scratch_numel(NUMELS, me, 2))
    p2p.all_gather(fulls, shards, TorchTransport(group), tag=1).wait()
    work, result = p2p.reduce_scatter(grads, scratch, TorchTransport(group), tag=2)
    work.wait()
    return {"me": me, "gathered": fulls, "reduced": result()}


def test_p2p_in_a_subgroup_uses_group_ranks():
    out = run(_subgroup_worker, world_size=3, timeout=90)
    assert out[1] is None
    for res in (out[0], out[2]):
        for i, n in enumerate(NUMELS):
            assert torch.equal(res["gathered"][i], _full(i, n, -1)), n
            total = _full(i, n, 0) + _full(i, n, 1)
            assert torch.equal(res["reduced"][i], layout.rank_slice(total, res["me"], 2)), n


def test_a_refresh_goes_by_rows_only_into_the_padded_buffers_a_gather_made():
    """P2P.refresh gathers into the full values the last gather made: by rows where they lie at
    the start of buffers padded to W * s_i ([Note: packed groups in rows]), else span by span."""
    from fz3.interpreters.carriers import _padded_bases
    bufs = [torch.zeros(6), torch.zeros(4)]
    fulls = [bufs[0][:5], bufs[1]]  # 5 elements padded to 6 at W = 2; 4 unpadded
    assert [b is x for b, x in zip(_padded_bases(fulls, [6, 4]), bufs)] == [True, True]
    assert _padded_bases([torch.zeros(5), bufs[1]], [6, 4]) is None  # a value of its own: no buffer
    assert _padded_bases([bufs[0][1:6], bufs[1]], [6, 4]) is None  # not at its buffer's start
