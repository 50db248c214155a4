"""The persistent vector (fz3/core/pvec.py): every version keeps its own values, whatever is
read or written afterwards, in whatever order (rerooting must be invisible)."""
from __future__ import annotations

import random

import pytest

from fz3.core.pvec import Log, PVec


def test_basics():
    v = PVec([1, 2, 3])
    assert len(v) == 3 and v[0] == 1 and list(v) == [1, 2, 3] and repr(v) == "PVec([1, 2, 3])"
    assert v == PVec([1, 2, 3]) and v != PVec([1, 2]) and v != [1, 2, 3]
    with pytest.raises(TypeError):
        hash(v)
    assert len(PVec()) == 0 and list(PVec()) == []


@pytest.mark.parametrize("bad", [-1, 3, 100])
def test_index_errors(bad):
    v = PVec([1, 2, 3])
    message = rf"PVec index {bad} out of range \[0, 3\)"
    with pytest.raises(IndexError, match=message if bad < 0 else "out of range"):  # past the end: the list's
        v[bad]
    with pytest.raises(IndexError, match=message):
        v.set(bad, 0)
    with pytest.raises(IndexError, match=message):
        v.set_many({0: 9, bad: 0})
    assert list(v) == [1, 2, 3]  # a refused update changes nothing


def test_set_leaves_the_old_version():
    v0 = PVec([0, 0, 0])
    v1 = v0.set(1, 5)
    v2 = v1.set_many({0: 7, 2: 8})
    assert (list(v0), list(v1), list(v2)) == ([0, 0, 0], [0, 5, 0], [7, 5, 8])
    assert v2[0] == 7 and v0[0] == 0 and v1[1] == 5 and v2[2] == 8  # interleaved reads
    assert v1.set_many({}) is v1


def test_fork_from_an_old_version():
    v0 = PVec(range(4))
    v1 = v0.set(0, "a")
    v2 = v0.set(0, "b")  # a second branch from v0
    v3 = v1.set(3, "c")
    assert [list(v) for v in (v3, v0, v2, v1)] == [
        ["a", 1, 2, "c"], [0, 1, 2, 3], ["b", 1, 2, 3], ["a", 1, 2, 3]]


def test_begin_edits_the_next_version_in_place():
    v0 = PVec([1, 2, 3])
    v1, arr, olds = v0.begin()
    for i, x in ((0, 10), (0, 11), (2, 30)):  # the protocol: record before the first write
        if i not in olds:
            olds[i] = arr[i]
        arr[i] = x
    assert list(v1) == [11, 2, 30] and list(v0) == [1, 2, 3] and v0.current() == [1, 2, 3]
    assert list(v1) == [11, 2, 30]


@pytest.mark.parametrize("seed", range(5))
def test_random_versions_against_lists(seed):
    """Random sets on random versions, random reads: each version reads as its list copy."""
    rng = random.Random(seed)
    versions = [(PVec([0] * 40), [0] * 40)]
    for step in range(300):
        v, model = rng.choice(versions)
        if rng.random() < 0.5:
            changes = {rng.randrange(40): step for _ in range(rng.randrange(4))}
            new = dict(enumerate(model))
            new.update(changes)
            versions.append((v.set_many(changes), [new[i] for i in range(40)]))
        else:
            i = rng.randrange(40)
            assert v[i] == model[i]
    for v, model in versions:
        assert list(v) == model and v.current() == model


def test_log_versions_keep_their_items():
    """Extending the newest version appends in place; extending an older one branches off a
    copy, and neither disturbs what any other version reads."""
    a = Log()
    b = a.extend([1, 2])
    c = b.extend([3])
    assert b._items is c._items  # the newest version grew in place
    d = b.extend([9])  # b is no longer the newest: branch
    assert d._items is not c._items
    e = a.extend([7])
    assert [list(v) for v in (a, b, c, d, e)] == [[], [1, 2], [1, 2, 3], [1, 2, 9], [7]]
    assert len(c) == 3 and c == Log([1, 2, 3]) and c != d and repr(d) == "Log([1, 2, 9])"
    with pytest.raises(TypeError):
        hash(c)


def test_log_random_histories():
    rng = random.Random(0)
    versions = [(Log(), [])]
    for _ in range(300):
        log, want = rng.choice(versions)
        xs = [rng.randrange(100) for _ in range(rng.randrange(3))]
        versions.append((log.extend(xs), want + xs))
    assert all(list(log) == want and len(log) == len(want) for log, want in versions)


@pytest.mark.parametrize("seed", range(5))
def test_log_equality_against_lists(seed):
    """[Note: log comparisons]: two lineages extended side by side, mostly alike (a replayed
    pass's log against the recorded one), sometimes branched from an older version or apart by
    one item, compared after every extend and at random older versions: Log == is list ==
    whatever the pairs compared before."""
    rng = random.Random(seed)
    a, b = [(Log(), [])], [(Log(), [])]
    for _ in range(400):
        for side in (a, b):
            log, want = side[-1] if rng.random() < 0.9 else rng.choice(side)
            xs = [rng.randrange(3) for _ in range(rng.randrange(3))]
            side.append((log.extend(xs), want + xs))
        for (x, wx), (y, wy) in [(a[-1], b[-1]), (rng.choice(a), rng.choice(b)), (a[-1], rng.choice(a))]:
            assert (x == y) == (wx == wy), (wx, wy)
