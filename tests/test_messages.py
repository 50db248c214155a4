"""fz3/interpreters/messages.py: which params of one collective travel together."""
from __future__ import annotations

from hypothesis import given, strategies as st

from fz3.interpreters.messages import groups


def test_small_params_share_a_group_and_large_ones_travel_alone():
    assert groups([4, 100, 0, 8, 3], small=10) == ((0, 3, 4), (1,))
    assert groups([4, 100, 8], small=0) == ((0,), (1,), (2,))
    assert groups([6, 6, 6, 6], small=10, most=12) == ((0, 1), (2, 3))
    assert groups([], small=10) == ()


@given(st.lists(st.integers(0, 50), max_size=30), st.integers(0, 60), st.integers(1, 80))
def test_every_param_with_elements_travels_once_in_order(numels, small, most):
    gs = groups(numels, small=small, most=most)
    flat = [i for g in gs for i in g]
    assert sorted(flat) == [i for i, n in enumerate(numels) if n > 0]
    for g in gs:
        assert list(g) == sorted(g)
        if len(g) > 1:
            assert all(numels[i] <= small for i in g)
            assert sum(numels[i] for i in g) <= most
    packed = [g for g in gs if numels[g[0]] <= small]
    assert gs[:len(packed)] == tuple(packed)  # packed groups first, then the large params
    for a, b in zip(packed, packed[1:]):  # a new group starts only when the next would not fit
        assert sum(numels[i] for i in a) + numels[b[0]] > most
