"""The shards params were built with, kept until `fz3.initialize` hands them to the tensor store.

`fz3.Init` (fz3/build/init.py) builds each param already sharded: the param's .data becomes a
placeholder and its shard is kept here (`keep`). At `fz3.initialize` the engine takes each
param's shard (`initial_shards`): the kept one, else one cut from the param's full value. So the
shell gets its shards from the data plane, not from the feature that built them.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from fz3.data import layout


@dataclass
class Shard:
    """What a closed param keeps on this rank."""
    data: torch.Tensor  # (s,) this rank's shard, the param's dtype, on the group's device
    rank: int
    world_size: int
    placeholder: torch.Tensor  # what the param's .data is while closed


_SHARDS: dict[int, tuple["weakref.ref[nn.Parameter]", Shard]] = {}
"""id(param) -> (a weak reference to it, its shard), from closing until fz3.initialize takes it;
a dropped param's entry goes with it ([Note: no WeakKeyDictionary of tensors] in fz3/shell/registry.py)."""


def shard_of(param: nn.Parameter) -> Shard | None:
    """The shard of a param built under fz3.Init that is still closed, else None."""
    entry = _SHARDS.get(id(param))
    if entry is None or entry[0]() is not param or not _is_placeholder(param, entry[1]):
        return None
    return entry[1]


def initial_shards(params, names, *, rank: int, world_size: int, device: torch.device) -> list[torch.Tensor]:
    """This rank's fp32 shard of each param, handed to the tensor store at fz3.initialize: the
    one fz3.Init built (take_shard), else cut from the param's full value."""
    out = []
    for p, name in zip(params, names):
        shard = take_shard(p, name, rank=rank, world_size=world_size)
        if shard is None:
            shard = layout.shard_of(p.detach().to(device=device, dtype=torch.float32), rank, world_size)
        out.append(shard)
    return out


def take_shard(param: nn.Parameter, name: str, *, rank: int, world_size: int) -> torch.Tensor | None:
    """For fz3.initialize: the shard of an Init-built param (now the engine's), else None.
    Raises if the param was built for another world size or rank, or replaced outside the
    block (model.to(...), .data = ...) so that its placeholder no longer stands for the shard."""
    entry = _SHARDS.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    shard = entry[1]
    if not _is_placeholder(param, shard):
        raise RuntimeError(f"param {name!r} was built under fz3.Init, then its value was replaced "
                           "outside the Init block (model.to(...), .half(), .data = ...): the new "
                           "value is not the model's. Cast or re-initialize inside `with fz3.Init():`;"
                           " fz3.initialize puts the shards on the device itself")
    if world_size == 1 and shard.world_size > 1:
        raise RuntimeError(f"param {name!r} was built under fz3.Init, split over {shard.world_size} ranks, and "
                           "fz3.initialize keeps params whole on every rank here (ZeRO stage 0: whole weights and "
                           "optimizer state, data parallel): build the model without fz3.Init at stage 0, or use "
                           "stage 1-3")
    if (shard.rank, shard.world_size) != (rank, world_size):
        raise RuntimeError(f"param {name!r} was built under fz3.Init for rank {shard.rank} of "
                           f"{shard.world_size}, but fz3.initialize runs rank {rank} of {world_size}: "
                           "build the model with the same process group")
    del _SHARDS[id(param)]
    return shard.data.to(param.dtype)  # model.half() outside the block changes the dtype only


def _is_placeholder(param: nn.Parameter, shard: Shard) -> bool:
    return (param.untyped_storage().data_ptr() == shard.placeholder.untyped_storage().data_ptr()
            and param.shape == shard.placeholder.shape and param.stride() == shard.placeholder.stride())


def keep(param: nn.Parameter, shard: Shard) -> None:
    """Keep `shard` for `param` (fz3.Init closing it); dropped with the param."""
    key = id(param)
    _SHARDS[key] = (weakref.ref(param, lambda _, key=key: _SHARDS.pop(key, None)), shard)


def kept(param: nn.Parameter) -> Shard | None:
    """The shard kept for `param`, whether or not its placeholder still stands for it."""
    entry = _SHARDS.get(id(param))
    return entry[1] if entry is not None and entry[0]() is param else None
