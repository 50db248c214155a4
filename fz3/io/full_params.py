"""`engine.full_params(bucket_bytes=...)`: every param whole, a bucket at a time, for a weight sync
to an inference engine or a save_pretrained, with no rank holding the whole model.

    for name, tensor in engine.full_params(bucket_bytes=2**28):   # every rank iterates
        inference_engine.load_weights([(name, tensor)])           # copy what you keep

The params, in the model's order (named_parameters: a tied param once, under its first name),
are cut into buckets of consecutive params of at most `bucket_bytes` of full values in the
compute dtype (fz3/data/store.py `consecutive_runs`, as the flat step cuts its segments). Each bucket is gathered at once (as fz3.gathered_parameters
gathers: fz3/core/param/hold.py), its params yielded whole (the gathered values themselves, in
their shapes: read or copy them before the next), and freed before the next bucket is gathered:
beyond its shards, a rank holds at most one bucket (and the persistent params, which are whole
anyway). A param larger than a bucket is refused, not split: a consumer loads a tensor whole.
trl PR #6713 all-gathers the whole model for the same sync; DeepSpeed's
_zero3_consolidated_16bit_state_dict gathers one param at a time (a collective per param).
"""
from __future__ import annotations

from typing import Iterator

import torch

from fz3.core.events import Hold, Unhold
from fz3.data.store import consecutive_runs
from fz3.shell.memory import human_bytes


def full_params(engine, bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Checked at the call; the buckets gathered as the iteration reaches them."""
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"engine.full_params(bucket_bytes={bucket_bytes!r}): the bucket is an int of bytes >= 1 "
                         "(the full params a rank holds at once beyond its shards)")
    elem = engine.store.dtype.itemsize
    named = [(name, engine.param_ids[id(p)]) for name, p in engine.module.named_parameters()]
    sizes = [engine.spec.params[p].numel * elem for _, p in named]
    if named and max(sizes) > bucket_bytes:
        i = max(range(len(sizes)), key=sizes.__getitem__)
        raise ValueError(f"engine.full_params(bucket_bytes={bucket_bytes:,}): param {named[i][0]!r} alone takes "
                         f"{sizes[i]:,} bytes ({human_bytes(sizes[i])}) whole in {engine.store.dtype}, and a param "
                         f"is yielded whole, never split (a consumer loads each tensor whole): give at least "
                         f"{sizes[i]:,}")
    return _bucket_by_bucket(engine, named, consecutive_runs(sizes, bucket_bytes))


def _bucket_by_bucket(engine, named, runs) -> Iterator[tuple[str, torch.Tensor]]:
    for run in runs:
        pids = tuple(sorted({named[i][1] for i in run}))
        engine.apply(Hold(params=pids))
        try:
            for i in run:
                name, p = named[i]
                yield name, engine.tables.params[p].detach()
        finally:
            engine.apply(Unhold(params=pids, stale=False))
