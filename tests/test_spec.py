"""Static tables (fz3/core/spec.py): shard layout numbers and build_spec validation."""
from __future__ import annotations

import pytest

from fz3.core.spec import build_spec, padding, persistent_flags, shard_numel

# (numel, world size) -> (shard numel, padding)
LAYOUT = [(0, 1, 0, 0), (0, 4, 0, 0), (1, 4, 1, 3), (3, 4, 1, 1), (4, 4, 1, 0), (5, 4, 2, 3),
          (10, 3, 4, 2), (7, 1, 7, 0)]


@pytest.mark.parametrize("numel,world,shard,pad", LAYOUT)
def test_layout(numel, world, shard, pad):
    assert (shard_numel(numel, world), padding(numel, world)) == (shard, pad)
    assert shard * world == numel + pad


def test_build_spec_tables():
    spec = build_spec([("emb.w", 10), ("b", 2), ("empty", 0)],
                      [("", [2], False), ("emb", [0], False), ("head", [0, 0, 1], False),
                       ("moe", [1, 0], True)], world_size=4, persistence_threshold=2)
    assert [p.shard_numel for p in spec.params] == [3, 1, 0]
    assert [p.persistent for p in spec.params] == [False, True, True]
    head = spec.modules[2]
    assert head.params == (0, 1) and head.numel == 12  # tied ids appear once, sorted
    assert spec.modules[3].is_leaf and spec.modules[3].params == (0, 1)
    assert [(p.id, p.name) for p in spec.params] == [(0, "emb.w"), (1, "b"), (2, "empty")]
    assert [(m.id, m.name) for m in spec.modules] == [(0, ""), (1, "emb"), (2, "head"), (3, "moe")]
    assert spec.world_size == 4


def test_one_rank_is_a_world():
    spec = build_spec([("w", 3)], [("m", [0], False)], world_size=1, persistence_threshold=0)
    assert spec.world_size == 1 and spec.params[0].shard_numel == 3


@pytest.mark.parametrize("params,modules,world,message", [
    ([("w", 1)], [("m", [0], False)], 0, r"world_size must be an int >= 1, got 0"),
    ([("w", 1)], [("m", [0], False)], True, r"world_size must be an int >= 1, got True"),
    ([("w", -1)], [("m", [0], False)], 1, r"param 'w' has numel -1; expected an int >= 0"),
    ([("w", 1.0)], [("m", [0], False)], 1, r"param 'w' has numel 1.0"),
    ([("w", 1)], [("m", [1], False)], 1, r"module 'm' names param id 1; ids run 0\.\.0"),
])
def test_build_spec_rejects(params, modules, world, message):
    with pytest.raises(ValueError, match=message):
        build_spec(params, modules, world_size=world, persistence_threshold=0)


@pytest.mark.parametrize("numels, param_threshold, model_threshold, flags", [
    ([3, 5, 2], 4, None, (True, False, True)),  # no cap: numel <= param threshold
    ([3, 3, 3], 4, 6, (True, True, False)),  # the cap fills in param order
    ([3, 4, 1, 2], 10, 5, (True, False, True, False)),  # 4 would overflow; later 1 still fits
    ([2, 2], 4, 0, (False, False)),
    ([0, 3], 0, 0, (True, False)),  # an empty param persists at no cost
    ([5, 3], 4, 3, (False, True)),  # a param too large to keep uses none of the cap
])
def test_persistent_flags_mirror_deepspeed(numels, param_threshold, model_threshold, flags):
    """DeepSpeed: DeepSpeedZeRoOffload.mark_persistent_parameters."""
    assert persistent_flags(numels, param_threshold, model_threshold) == flags
    spec = build_spec([(f"p{i}", n) for i, n in enumerate(numels)], [("root", range(len(numels)), False)],
                      world_size=2, persistence_threshold=param_threshold,
                      model_persistence_threshold=model_threshold)
    assert tuple(p.persistent for p in spec.params) == flags
