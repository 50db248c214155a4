"""I4: the shard layout round-trips any numel and world size (padding, empty shards), and the
gather and reduce buffers pack and unpack consistently (the checks: fz3/testing/layout_check.py)."""
from hypothesis import given
from hypothesis import strategies as st

from fz3.testing import layout_check as lc


@given(lc.numels, lc.worlds, lc.seeds, lc.shapes)
def test_i4_shard_unshard_round_trip(n, w, seed, shape_kind):
    lc.round_trip(n, w, seed, shape_kind)


@given(st.lists(lc.numels, max_size=6), lc.worlds, lc.seeds)
def test_i4_gather_buffer_round_trip(ns, w, seed):
    lc.gather_round_trip(ns, w, seed)


@given(st.lists(lc.numels, max_size=6), lc.worlds, lc.seeds)
def test_reduce_buffers_give_each_rank_its_own_slices(ns, w, seed):
    lc.reduce_slices(ns, w, seed)
