"""`engine.full_params(bucket_bytes=...)`: every param whole, a bucket at a time, for a weight sync
to an inference engine or a save_pretrained, with no rank holding the whole model.

    for name, tensor in engine.full_params(bucket_bytes=2**28):   # every rank iterates
        inference_engine.load_weights([(name, tensor)])           # copy what you keep

The params, in the model's order (named_parameters: a tied param once, under its first name),
are cut into buckets of consecutive params of at most `bucket_bytes` of full values in the
compute dtype (fz3/data/store.py `consecutive_runs`, as the flat step cuts its segments).
Each bucket is gathered at once (as fz3.gathered_parameters gathers: fz3/core/param/hold.py),
its params yielded whole (the gathered values themselves, in
their shapes: read or copy them before the next), and freed before the next bucket is gathered:
beyond its shards, a rank holds at most one bucket (and the persistent params, which are whole
anyway). A param larger than a bucket is refused, not split: a consumer loads a tensor whole.
LoRA adapters are merged on the way out ([Note: LoRA merged on the way out]).
trl PR #6713 all-gathers the whole model for the same sync; DeepSpeed's
_zero3_consolidated_16bit_state_dict gathers one param at a time (a collective per param).
"""
from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from fz3.core.events import Hold, Unhold
from fz3.data.store import consecutive_runs
from fz3.shell.memory import human_bytes


def full_params(engine, bucket_bytes: int, merge_lora: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Checked at the call; the buckets gathered as the iteration reaches them."""
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"engine.full_params(bucket_bytes={bucket_bytes!r}): the bucket is an int of bytes >= 1 "
                         "(the full params a rank holds at once beyond its shards)")
    elem = engine.store.dtype.itemsize
    lora = _lora_layers(engine) if merge_lora else {}
    adapters = {pid for m in lora.values() for pid in _adapter_params(engine, m)}
    named = [(name, engine.param_ids[id(p)]) for name, p in engine.module.named_parameters()
             if engine.param_ids[id(p)] not in adapters]
    sizes = [engine.spec.params[p].numel * elem for _, p in named]
    if named and max(sizes) > bucket_bytes:
        i = max(range(len(sizes)), key=sizes.__getitem__)
        raise ValueError(f"engine.full_params(bucket_bytes={bucket_bytes:,}): param {named[i][0]!r} alone takes "
                         f"{sizes[i]:,} bytes ({human_bytes(sizes[i])}) whole in {engine.store.dtype}, and a param "
                         f"is yielded whole, never split (a consumer loads each tensor whole): give at least "
                         f"{sizes[i]:,}")
    return _bucket_by_bucket(engine, named, consecutive_runs(sizes, bucket_bytes), lora)


def _bucket_by_bucket(engine, named, runs, lora: dict) -> Iterator[tuple[str, torch.Tensor]]:
    for run in runs:
        pids = {named[i][1] for i in run}
        for i in run:  # a LoRA layer's adapters, gathered with its base weight
            if named[i][1] in lora:
                pids.update(_adapter_params(engine, lora[named[i][1]]))
        pids = tuple(sorted(pids))
        engine.apply(Hold(params=pids))
        try:
            for i in run:
                name, p = named[i]
                value = engine.tables.params[p].detach()
                if lora:
                    name = _base_name(name)
                    if p in lora:
                        value = _merged(lora[p], value)
                yield name, value
        finally:
            engine.apply(Unhold(params=pids, stale=False))


# [Note: LoRA merged on the way out] With PEFT's LoRA on the model (peft's tuner layers: a
# base_layer and its lora_A / lora_B), full_params yields what the merged model would hold: each
# adapted weight as W + delta (the layer's get_delta_weight for each active adapter, computed from
# the adapters gathered with W's bucket, in a new tensor: W itself stays unmerged), the adapters
# themselves not at all, and every name as the base model names it (PEFT's "base_model.model."
# and ".base_layer" taken out): what an inference engine's weight sync or the base model's
# save_pretrained reads. TRL merges the adapters in place around its sync (merge_adapter /
# unmerge_adapter), which under ZeRO-3 nests gathers (trl PR #6386).


def _lora_layers(engine) -> dict[int, nn.Module]:
    """ParamId of each LoRA-adapted base weight -> its PEFT layer (active adapters not merged)."""
    out = {}
    for m in engine.module.modules():
        base = getattr(m, "base_layer", None)
        if base is None or not hasattr(m, "lora_A") or not hasattr(m, "get_delta_weight") \
                or getattr(m, "merged", False):
            continue
        w = getattr(base, "weight", None)
        if w is not None and id(w) in engine.param_ids:
            out[engine.param_ids[id(w)]] = m
    return out


def _adapter_params(engine, layer: nn.Module) -> list[int]:
    return [engine.param_ids[id(p)] for name, p in layer.named_parameters()
            if name.startswith(("lora_A.", "lora_B.")) and id(p) in engine.param_ids]


def _merged(layer: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    out = weight.clone()
    for adapter in layer.active_adapters:
        if adapter in layer.lora_A:
            out += layer.get_delta_weight(adapter).to(out.dtype)
    return out


def _base_name(name: str) -> str:
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")
