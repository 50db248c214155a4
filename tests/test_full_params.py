"""engine.full_params(bucket_bytes) (issue #50, point 6; fz3/io/full_params.py): every param
whole, a bucket at a time.

    values     on 2 thread ranks every rank gets every param, named as named_parameters names it
               (a tied one once), equal to the unsharded model's, in the compute dtype
    bounded    at each yield, what a rank holds gathered beyond the persistent params is at most
               one bucket; after the loop (or a break) nothing stays gathered
    buckets    runs of consecutive params within the bucket, each closed only when the next param
               would overflow it
    errors     a bucket smaller than the largest param (named, with its bytes), not an int
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fz3
from fz3 import launch
from fz3.data.store import consecutive_runs

pytestmark = pytest.mark.timeout(300)


def _net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(11, 8), nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.Linear(8, 11))
    net[4].weight = net[0].weight  # tied: one param, two names
    return net


def _export(rank: int, world: int, bucket: int, dtype: str, stop: int | None) -> dict:
    model = _net()
    engine = fz3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            fz3.Config(param_persistence_threshold=8, compute_dtype=dtype))
    engine(torch.zeros(1, 3, dtype=torch.long))  # a forward: the persistent params are whole from here on
    base = engine.stats()["live_numel"]
    elem = engine.store.dtype.itemsize
    got, extra = [], []
    for i, (name, t) in enumerate(engine.full_params(bucket_bytes=bucket)):
        if i == stop:
            break
        got.append((name, t.clone()))
        extra.append((engine.stats()["live_numel"] - base) * elem)
    return {"got": got, "extra": extra, "after": engine.stats()["live_numel"] - base}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_every_rank_gets_every_param_whole_within_one_bucket(dtype):
    bucket = 11 * 8 * 4 + 8 * 16 * 4  # the embedding and the first Linear's weight, in fp32
    outs = launch.run_threads(_export, 2, args=(bucket, dtype, None))
    want = [(n, p.detach()) for n, p in _net().named_parameters()]
    cast = torch.float32 if dtype == "fp32" else torch.bfloat16
    for o in outs:
        assert [n for n, _ in o["got"]] == [n for n, _ in want]  # the tied weight once
        for (n, t), (_, w) in zip(o["got"], want):
            assert t.dtype == cast and torch.equal(t, w.to(cast)), n
        assert max(o["extra"]) <= bucket and o["after"] == 0, (o["extra"], o["after"])
    assert max(outs[0]["extra"]) > 0


def test_a_loop_left_early_frees_its_bucket():
    outs = launch.run_threads(_export, 2, args=(1_000, "fp32", 2))
    assert all(o["after"] == 0 and len(o["got"]) == 2 for o in outs)


def _refused(rank: int, world: int) -> dict:
    model = _net()
    engine = fz3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), fz3.Config())
    said = {}
    for key, bucket in (("small", 100), ("float", 1e6)):
        try:
            engine.full_params(bucket_bytes=bucket)
        except ValueError as e:
            said[key] = str(e)
    return said


def test_bad_buckets_are_refused_at_the_call():
    said = launch.run_threads(_refused, 2)[0]
    assert "param '1.weight' alone takes 512 bytes" in said["small"] and "give at least 512" in said["small"]
    assert "never split" in said["small"]
    assert "an int of bytes >= 1" in said["float"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 20), max_size=12), st.integers(20, 60))
def test_buckets_are_consecutive_runs_within_the_limit_closed_only_when_full(sizes, limit):
    runs = consecutive_runs(sizes, limit)
    assert [i for r in runs for i in r] == list(range(len(sizes)))
    for a, b in zip(runs, runs[1:]):
        assert sum(sizes[i] for i in a) + sizes[b[0]] > limit  # the next would overflow it
    assert all(sum(sizes[i] for i in r) <= limit for r in runs)
