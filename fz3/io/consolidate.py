"""Whole parameters out of shards: `full_state_dict` and `gathered_parameters`.

    engine.full_state_dict()                      every rank gets the fp32 params (+ buffers),
                                                  keys as model.state_dict()
    with fz3.gathered_parameters(params_or_module, modifier_rank=None):
        ...                                       the params are whole; with modifier_rank=r,
                                                  rank r's edits are broadcast and re-sharded
DeepSpeed: _zero3_consolidated_16bit_state_dict, zero.GatheredParameters.
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, Optional, Union

import torch
from torch import nn

from fz3.core.events import Hold, Unhold
from fz3.shell import log
from fz3.shell.registry import engine_of


def _gather_master(engine, p: int) -> torch.Tensor:
    """(numel,) fp32 full value of param p from every rank's master shard."""
    shard = engine.store.masters[p].detach().to(engine.store.device)  # host masters (offload): over the device's link
    out = torch.empty(shard.numel() * engine.world_size, dtype=shard.dtype, device=shard.device)
    engine.transport.all_gather_into(out, shard.contiguous())
    return out[:engine.spec.params[p].numel]


def full_state_dict(engine) -> dict[str, torch.Tensor]:
    """Every rank: the fp32 params from the masters, and the buffers: rank 0's, broadcast first
    (Options.broadcast_buffers, the default), else this rank's own (a WARNING says so, once)."""
    engine.buffers.sync()
    if not engine.options.broadcast_buffers:
        log.own_buffers(engine)
    full = {id(param): _gather_master(engine, p).view(param.shape if param.numel() else engine.store.shapes[p])
            for p, param in enumerate(engine.tables.params)}
    out = {}
    for name, t in engine.module.state_dict(keep_vars=True).items():
        if id(t) in full:
            out[name] = full[id(t)].clone()
        else:
            out[name] = t.detach().clone()
    return out


def compute_dtype_state_dict(engine, *, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor] | None:
    """Rank 0: the whole params in the compute dtype (the values a forward gathers: each fp32
    master cast once) on the CPU, and the persistent buffers (rank 0's own), keys as
    model.state_dict(); a param tied under two names is one tensor. Other ranks: None. Every
    rank must call it; one param is whole at a time. DeepSpeed: _zero3_consolidated_16bit_state_dict."""
    engine.buffers.sync()
    dtype = engine.store.dtype
    out: dict[str, torch.Tensor] | None = {} if engine.rank == 0 else None
    done: dict[int, torch.Tensor] = {}
    trainable = {id(p): p.requires_grad for p in engine.tables.params}
    for name, t in engine.module.state_dict(keep_vars=True).items():
        if id(t) not in engine.param_ids:
            if out is not None:
                out[name] = t.detach().cpu().clone()
            continue
        if exclude_frozen_parameters and not trainable[id(t)]:
            continue
        if id(t) not in done:
            p = engine.param_ids[id(t)]
            full = _gather_master(engine, p).view(t.shape if t.numel() else engine.store.shapes[p])
            done[id(t)] = full.to(dtype).cpu() if out is not None else full[:0]
        if out is not None:
            out[name] = done[id(t)]
    return out


@contextlib.contextmanager
def gathered_parameters(params: Union[nn.Module, nn.Parameter, Iterable[nn.Parameter]],
                        modifier_rank: Optional[int] = None) -> Iterator[None]:
    """Make `params` whole inside the block. Every rank must enter it (it gathers).

    modifier_rank=None: edits are discarded on exit. modifier_rank=r: rank r's values are
    broadcast on exit and become every rank's new shards (and fp32 masters).
    """
    if isinstance(params, nn.Module):
        params = list(params.parameters())
    elif isinstance(params, nn.Parameter):
        params = [params]
    params = list(params)
    by_engine: dict[int, tuple[object, list[int]]] = {}
    for param in params:
        engine = engine_of(param)
        if engine is None:
            raise ValueError(f"gathered_parameters: a parameter of shape {tuple(param.shape)} is not "
                             "managed by an fz3 engine (call fz3.initialize first)")
        by_engine.setdefault(id(engine), (engine, []))[1].append(engine.param_ids[id(param)])
    for engine, pids in by_engine.values():
        if modifier_rank is not None and not 0 <= modifier_rank < engine.world_size:
            raise ValueError(f"modifier_rank={modifier_rank}: expected None or a rank in "
                             f"[0, {engine.world_size})")
        engine.apply(Hold(params=tuple(sorted(set(pids)))))
    try:
        yield
    finally:
        for engine, pids in by_engine.values():
            pids = tuple(sorted(set(pids)))
            if modifier_rank is not None:
                with engine.resident():  # the masters are written (optimizer offload: on disk until now)
                    for p in pids:
                        full = engine.tables.params[p].data
                        engine.transport.broadcast(full, src=modifier_rank)
                        engine.store.write_full(p, full)
            engine.apply(Unhold(params=pids, stale=modifier_rank is not None))
