"""I4, the shard layout, as checks over one drawn case each: property_tests/test_layout_properties.py
draws them for pytest, `python -m fz3 verify` for the command line.

    round_trip            shard/unshard gives back any numel at any world size; padding is zeros;
                          rank r owns flat [r*s, (r+1)*s), as in DeepSpeed
    gather_round_trip     the all-gather buffer unpacks to every param's full value on every rank
    reduce_slices         both reduce paths give each rank its own slice of the summed grads
"""
from __future__ import annotations

from typing import Sequence

import torch
import fz3.testing.extra  # noqa: F401 - Hypothesis, or an ImportError naming the test extra
from hypothesis import strategies as st

from fz3.core.spec import padding, shard_numel
from fz3.data import collectives, layout
from fz3.testing.coverage import covered

numels = st.integers(0, 40)
worlds = st.integers(1, 4)
seeds = st.integers(0, 2**32 - 1)
shapes = st.sampled_from([(), (1,), (-1,)])


def values(seed: int, n: int) -> torch.Tensor:
    return torch.randint(-9, 10, (n,), generator=torch.Generator().manual_seed(seed)).float()


def round_trip(n: int, w: int, seed: int, shape_kind: tuple) -> None:
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
    empty = sum(min((r + 1) * s, n) <= r * s for r in range(w))
    covered("I4", f"shard/unshard, W={w}, {'padded' if padding(n, w) else 'exact'}"
            f"{', empty shards' if empty else ''}")


def gather_round_trip(ns: Sequence[int], w: int, seed: int) -> None:
    fulls = [values(seed + i, n) for i, n in enumerate(ns)]
    shards = [[layout.shard_of(f, r, w) for f in fulls] for r in range(w)]
    for got in collectives.gather_world(shards, ns):
        assert len(got) == len(ns) and all(torch.equal(a, b) for a, b in zip(got, fulls))
    covered("I4", f"gather buffer, W={w}")


def reduce_slices(ns: Sequence[int], w: int, seed: int) -> None:
    grads = [[values(seed + 100 * r + i, n) for i, n in enumerate(ns)] for r in range(w)]
    total = [sum(g[i] for g in grads) if grads else None for i in range(len(ns))]
    for path in ("allreduce", "reduce_scatter"):
        parts = collectives.reduce_world(grads, path)
        for r in range(w):
            for i in range(len(ns)):
                assert torch.equal(parts[r][i], layout.shard(total[i], w)[r]), (path, r, i)
        covered("I4", f"reduce buffers, {path}, W={w}")
