"""Teeth for I4: the layout properties (test_layout_properties.py, fz3/testing/layout_check.py)
must catch a broken layout, each within the examples allowed.

    (a) rank 1's shard off by one element
    (b) padding that is not zero (the last rank's tail filled with ones)
    (c) a rank's span one element short (rank_span's upper bound minus one)
    (d) the reduce-scatter input packed with the ranks' chunks in reverse order
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch.nn import functional as F

import fz3.data.collectives as collectives
import fz3.data.layout as layout
from fz3.testing import layout_check as lc

HUNT = settings(max_examples=100, derandomize=True, database=None, deadline=None,
                phases=(Phase.generate,), report_multiple_bugs=False,
                suppress_health_check=list(HealthCheck))


def assert_caught() -> None:
    @HUNT
    @given(lc.numels, lc.worlds, lc.seeds, lc.shapes, st.lists(lc.numels, max_size=6))
    def hunt(n, w, seed, shape_kind, ns):
        lc.round_trip(n, w, seed, shape_kind)
        lc.gather_round_trip(ns, w, seed)
        lc.reduce_slices(ns, w, seed)

    with pytest.raises(AssertionError):
        hunt()


def test_a_shard_off_by_one_is_caught(monkeypatch):
    real = layout.shard_of
    monkeypatch.setattr(layout, "shard_of", lambda f, r, w: real(f, r, w) + (r == 1))
    assert_caught()


def test_padding_that_is_not_zero_is_caught(monkeypatch):
    def pad_flat(full, w):
        flat = full.reshape(-1)
        s = layout.shard_numel(flat.numel(), w)
        return F.pad(flat, (0, s * w - flat.numel()), value=1.0)

    monkeypatch.setattr(layout, "pad_flat", pad_flat)
    assert_caught()


def test_a_span_one_short_is_caught(monkeypatch):
    real = layout.rank_span

    def short(numel, rank, w):
        lo, hi = real(numel, rank, w)
        return lo, max(lo, hi - 1)

    monkeypatch.setattr(layout, "rank_span", short)
    assert_caught()


def test_reduce_scatter_chunks_in_reverse_rank_order_are_caught(monkeypatch):
    def reversed_pack(grads, w):
        if not grads:
            return torch.zeros(0)
        return torch.cat([layout.shard(g, w) for g in grads], dim=1).flip(0).reshape(-1)

    monkeypatch.setattr(collectives, "pack_reduce_scatter", reversed_pack)
    assert_caught()
