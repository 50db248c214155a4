"""fz3.data.layout: shard / unshard / rank_slice, padding, empty shards, torch.func."""
import pytest
import torch
from torch.func import grad, vmap

from fz3.core.spec import padding, shard_numel
from fz3.data import layout


@pytest.mark.parametrize("numel, w, rows", [
    (7, 3, [[1, 2, 3], [4, 5, 6], [7, 0, 0]]),
    (7, 4, [[1, 2], [3, 4], [5, 6], [7, 0]]),
    (2, 4, [[1], [2], [0], [0]]),  # ranks 2 and 3 hold padding only
    (6, 3, [[1, 2], [3, 4], [5, 6]]),  # divides: no padding
    (0, 3, [[], [], []]),  # empty shards
    (5, 1, [[1, 2, 3, 4, 5]]),
])
def test_shard_table(numel, w, rows):
    full = torch.arange(1.0, numel + 1)
    sh = layout.shard(full, w)
    assert sh.tolist() == rows
    assert sh.shape == (w, shard_numel(numel, w))
    assert layout.pad_flat(full, w).numel() == numel + padding(numel, w)
    for r in range(w):
        assert layout.shard_of(full, r, w).tolist() == rows[r]
        assert layout.rank_slice(full, r, w).tolist() == rows[r]
    assert torch.equal(layout.unshard(sh, (numel,)), full)
    assert torch.equal(layout.unshard(list(sh), (numel,)), full)


def test_unshard_restores_shape():
    full = torch.arange(12.0).reshape(3, 4)
    assert torch.equal(layout.unshard(layout.shard(full, 5), full.shape), full)


def test_inputs_untouched():
    for numel, w in ((5, 2), (6, 3), (0, 2)):
        full = torch.arange(float(numel))
        keep = full.clone()
        layout.shard(full, w), layout.rank_slice(full, w - 1, w), layout.unshard(
            layout.shard(full, w), (numel,))
        assert torch.equal(full, keep)


def test_grad_through_shard_and_unshard():
    full = torch.arange(7.0)
    g = grad(lambda t: (layout.shard(t, 3) * torch.arange(9.0).reshape(3, 3)).sum())(full)
    assert g.tolist() == list(range(7))  # padding positions get no gradient back
    g = grad(lambda sh: layout.unshard(sh, (7,)).sum())(layout.shard(full, 3))
    assert g.tolist() == [[1, 1, 1], [1, 1, 1], [1, 0, 0]]


def test_vmap_over_rank_axis():
    full = torch.arange(1.0, 8)
    rows = vmap(lambda sh: sh * 2)(layout.shard(full, 4))
    assert torch.equal(layout.unshard(rows, (7,)), full * 2)
    batch = torch.stack([full, -full])
    assert torch.equal(vmap(lambda t: layout.shard(t, 3))(batch)[1], -layout.shard(full, 3))


@pytest.mark.parametrize("n,world", [(10, 4), (7, 3), (2, 4), (0, 2), (9, 1)])
def test_rank_slice_into_writes_what_rank_slice_returns(n, world):
    """fz3.Init writes each rank's slice into its preallocated shard (fz3/build/init.py)."""
    flat = torch.arange(1, n + 1, dtype=torch.float32)
    for r in range(world):
        out = torch.full((shard_numel(n, world),), float("nan"))
        got = layout.rank_slice_into(flat, r, world, out)
        assert got is out and torch.equal(out, layout.rank_slice(flat, r, world)), (n, world, r)


def test_unshard_of_stacked_shards_copies_nothing():
    """(W, s) in one tensor (fz3.Init gathers every rank's shard into one such buffer,
    fz3/build/init.py): the full value is a view of it, no second full-size copy."""
    rows = layout.shard(torch.arange(1.0, 8), 3)
    full = layout.unshard(rows, (7,))
    assert full.untyped_storage().data_ptr() == rows.untyped_storage().data_ptr()
    assert full.tolist() == list(range(1, 8))
