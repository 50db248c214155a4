"""Effects are plain records: equal only to the same kind with the same fields."""
from __future__ import annotations

from fz3.core.effects import AllGather, AverageGrads, Free, Wait, WaitReduce, ZeroPartitions


def test_effects_compare_by_kind_and_value():
    assert Wait(2) == Wait(2) and Wait(2) != Wait(3)
    assert Wait(2) != AverageGrads(2) and Free((1,)) != ZeroPartitions((1,))  # same tuple, other kind
    assert WaitReduce() == WaitReduce() and WaitReduce() != ()
    assert len({Wait(2), AverageGrads(2), Wait(2)}) == 2
    assert repr(AllGather(1, (2, 3), True, False)) == \
        "AllGather(handle=1, params=(2, 3), prefetch=True, forward=False)"
