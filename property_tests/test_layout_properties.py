"""I4: the shard layout round-trips any numel and world size (padding, empty shards), and the
gather and reduce buffers pack and unpack consistently."""
import torch
from hypothesis import given
from hypothesis import strategies as st

from fz3.core.spec import padding, shard_numel
from fz3.data import collectives, layout

numels = st.integers(0, 40)
worlds = st.integers(1, 4)


def values(seed: int, n: int) -> torch.Tensor:
    return torch.randint(-9, 10, (n,), generator=torch.Generator().manual_seed(seed)).float()


@given(numels, worlds, st.integers(0, 2**32 - 1), st.sampled_from([(), (1,), (-1,)]))
def test_i4_shard_unshard_round_trip(n, w, seed, shape_kind):
    full = values(seed, n)
    if shape_kind == (1,) and n:
        full = full.reshape(1, n, 1)
    sh = layout.shard(full, w)
    s = shard_numel(n, w)
    assert sh.shape == (w, s)
    assert torch.equal(layout.unshard(sh, full.shape), full)
    assert torch.equal(sh.reshape(-1)[n:], torch.zeros(padding(n, w)))  # padding is zeros
    for r in range(w):  # rank r owns flat [r*s, (r+1)*s), as in DeepSpeed
        own = sh[r]
        assert torch.equal(layout.shard_of(full, r, w), own)
        lo, hi = min(r * s, n), min((r + 1) * s, n)
        assert torch.equal(own[:hi - lo], full.reshape(-1)[lo:hi])
        assert not own[hi - lo:].any()


@given(st.lists(numels, max_size=6), worlds, st.integers(0, 2**32 - 1))
def test_i4_gather_buffer_round_trip(ns, w, seed):
    fulls = [values(seed + i, n) for i, n in enumerate(ns)]
    shards = [[layout.shard_of(f, r, w) for f in fulls] for r in range(w)]
    for got in collectives.gather_world(shards, ns):
        assert len(got) == len(ns) and all(torch.equal(a, b) for a, b in zip(got, fulls))


@given(st.lists(numels, max_size=6), worlds, st.integers(0, 2**32 - 1))
def test_reduce_buffers_give_each_rank_its_own_slices(ns, w, seed):
    grads = [[values(seed + 100 * r + i, n) for i, n in enumerate(ns)] for r in range(w)]
    total = [sum(g[i] for g in grads) if grads else None for i in range(len(ns))]
    for path in ("allreduce", "reduce_scatter"):
        parts = collectives.reduce_world(grads, path)
        for r in range(w):
            for i in range(len(ns)):
                assert torch.equal(parts[r][i], layout.shard(total[i], w)[r]), (path, r, i)
