"""Effects are plain records: equal only to the same kind with the same fields."""
from __future__ import annotations

from typing import NamedTuple

from fz3.core.effects import (AllGather, AverageGrads, Free, Wait, WaitReduce, ZeroPartitions,
                              record)


def test_effects_compare_by_kind_and_value():
    assert Wait(2) == Wait(2) and Wait(2) != Wait(3)
    assert Wait(2) != AverageGrads(2) and Free((1,)) != ZeroPartitions((1,))  # same tuple, other kind
    assert WaitReduce() == WaitReduce() and WaitReduce() != ()
    assert len({Wait(2), AverageGrads(2), Wait(2)}) == 2
    assert repr(AllGather(1, (2, 3), True, False)) == \
        "AllGather(handle=1, params=(2, 3), prefetch=True, forward=False, secondary=())"


def _records():
    """Two record types with the same fields. `record` runs when fz3.core.effects is imported,
    so these tests apply it at test time: a change to the decorator shows here even in a
    process that imported the effects already."""
    class Pair(NamedTuple):
        x: int
        y: int

    class Twin(NamedTuple):
        x: int
        y: int

    assert Pair(1, 2) == Twin(1, 2)  # why `record` exists: NamedTuples compare as plain tuples
    return record(Pair), record(Twin)


def test_record_equal_only_to_the_same_type_with_the_same_fields():
    Pair, Twin = _records()
    a, b = Pair(1, 2), Pair(1, 2)
    assert a is not b
    assert (a == b) is True and (a != b) is False
    assert (Pair(1, 2) == Pair(1, 3)) is False and (Pair(1, 2) != Pair(1, 3)) is True
    assert (Pair(1, 2) == Twin(1, 2)) is False and (Pair(1, 2) != Twin(1, 2)) is True
    assert (Pair(1, 2) == (1, 2)) is False and (Pair(1, 2) != (1, 2)) is True


def test_record_hash_is_by_type_and_value():
    Pair, Twin = _records()
    assert hash(Pair(1, 2)) == hash(Pair(1, 2))
    assert hash(Pair(1, 2)) != hash(Twin(1, 2))  # same fields, other type
    assert hash(Pair(1, 2)) != hash(Pair(1, 3))
    keys = {Pair(1, 2): "pair", Twin(1, 2): "twin", Pair(1, 3): "other"}
    assert len(keys) == 3 and keys[Pair(1, 2)] == "pair" and keys[Twin(1, 2)] == "twin"
    assert {Pair(1, 2), Pair(1, 2), Twin(1, 2)} == {Twin(1, 2), Pair(1, 2)}
