"""fz3.data.collectives: pack/unpack, simulated collectives, both reduce paths, torch.func."""
import pytest
import torch
from torch.func import grad, vmap

from fz3.data import collectives as c


def rank_grads(numels, w, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(-4, 5, (n,), generator=g).float() for n in numels] for _ in range(w)]


def naive_partition(grads, i, r, w):
    total = sum(gr[i] for gr in grads)
    n = total.numel()
    s = -(-n // w)
    return torch.cat([total, torch.zeros(s * w - n)])[r * s:(r + 1) * s]


@pytest.mark.parametrize("numels, w", [([5, 3, 0, 1], 3), ([7], 4), ([2, 2], 1), ([1, 40, 6], 2),
                                       ([], 2), ([0, 0], 4)])
def test_both_reduce_paths_equal_the_naive_sum(numels, w):
    grads = rank_grads(numels, w)
    keep = [[t.clone() for t in gr] for gr in grads]
    for path in ("allreduce", "reduce_scatter"):
        parts = c.reduce_world(grads, path)
        for r in range(w):
            for i in range(len(numels)):
                assert torch.equal(parts[r][i], naive_partition(grads, i, r, w)), (path, r, i)
    assert all(torch.equal(a, b) for ga, gb in zip(grads, keep) for a, b in zip(ga, gb))


def test_reduce_scatter_input_is_rank_interleaved():
    # grads a = [1..5], b = [10, 20] on W=2: s_a = 3, s_b = 1
    packed = c.pack_reduce_scatter([torch.arange(1.0, 6), torch.tensor([10.0, 20.0])], 2)
    assert packed.tolist() == [1, 2, 3, 10, 4, 5, 0, 20]  # rank 0's chunk, then rank 1's
    assert [t.tolist() for t in c.unpack_reduce_scatter(packed[4:], [5, 2], 2)] == [[4, 5, 0], [20]]


def test_allreduce_slices_each_slot():
    flat = torch.arange(1.0, 9)  # slots (0, 5) and (5, 3) on W=2
    assert [t.tolist() for t in c.slice_allreduced(flat, [(0, 5), (5, 3)], 1, 2)] == [[4, 5, 0], [8, 0]]
    assert c.slot_offsets([5, 3, 0, 2]) == [0, 5, 8, 8]


@pytest.mark.parametrize("numels, w", [([5, 3], 3), ([7, 0, 1], 4), ([4], 1)])
def test_gather_round_trip(numels, w):
    fulls = [torch.arange(1.0, n + 1) * (i + 1) for i, n in enumerate(numels)]
    shards = [[torch.nn.functional.pad(f, (0, -(-f.numel() // w) * w - f.numel()))
               .reshape(w, -1)[r] for f in fulls] for r in range(w)]
    for got in c.gather_world(shards, numels):
        assert all(torch.equal(a, b) for a, b in zip(got, fulls))


def test_sim_collectives():
    xs = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])]
    assert [t.tolist() for t in c.sim_all_gather(xs)] == [[1, 2, 3, 4]] * 2
    assert [t.tolist() for t in c.sim_all_reduce(xs)] == [[4, 6]] * 2
    assert [t.tolist() for t in c.sim_reduce_scatter(xs)] == [[4], [6]]


def test_unknown_path():
    with pytest.raises(ValueError, match="unknown reduce path 'avg'"):
        c.reduce_world(rank_grads([3], 2), "avg")


def test_torch_func_through_reduce_and_gather():
    # d/dg of sum(partitions * weights): every grad element of every rank gets its slot's weight
    w = 2  # two grads of numel 3 and 2
    grads = torch.ones(w, 5)

    def f(flat):
        per_rank = [[flat[r, :3], flat[r, 3:]] for r in range(w)]
        return sum((p * (r + 1)).sum() for r, ps in enumerate(c.reduce_world(per_rank, "reduce_scatter"))
                   for p in ps)
    g = grad(f)(grads)
    assert g.tolist() == [[1, 1, 2, 1, 2]] * 2  # elements owned by rank 1 weigh 2
    packed = vmap(lambda a, b: c.pack_reduce_scatter([a, b], w))(grads[:, :3], grads[:, 3:])
    assert packed.shape == (w, 6)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_pack_reduce_scatter_into_matches_pack(world_size):
    """The in-place packing the interpreter uses equals the pure one, padding zeroed even when
    the buffer held garbage (numels 0, 1, < W, multiples of W, ragged)."""
    g = torch.Generator().manual_seed(world_size)
    grads = [torch.randint(-9, 9, (n,), generator=g).float() for n in (5, 0, 1, 8, 3, 12, 2)]
    want = c.pack_reduce_scatter(grads, world_size)
    buf = torch.full_like(want, float("nan"))
    assert torch.equal(c.pack_reduce_scatter_into(grads, world_size, buf), want)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_unpack_gather_into_matches_unpack(world_size):
    """The in-place unpacking the interpreter uses (one split_with_sizes_copy into each param's
    padded full value) equals the pure one and writes only `out`, all of it."""
    g = torch.Generator().manual_seed(world_size)
    numels = (5, 0, 1, 8, 3, 12, 2)
    shards = [[torch.randint(-9, 9, (c.shard_numel(n, world_size),), generator=g).float()
               for n in numels] for _ in range(world_size)]
    gathered = c.sim_all_gather([c.pack_gather(s) for s in shards])[0]
    want = c.unpack_gather(gathered, numels, world_size)
    out = torch.full((c.padded_numel(numels, world_size),), float("nan"))
    got = c.unpack_gather_into(gathered, numels, world_size, out)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(x.untyped_storage().data_ptr() == out.untyped_storage().data_ptr() for x in got)
    assert not out.isnan().any()


def test_packing_nothing_gives_an_empty_buffer():
    """An empty bucket (N = 0), like an empty gather or reduce-scatter input, is (0,)."""
    assert c.pack_bucket([]).shape == (0,)
    assert c.pack_gather([]).shape == (0,)
    assert c.pack_reduce_scatter([], 2).shape == (0,)
