"""A model built on the `meta` device, materialized one module at a time by fz3.initialize.

    with torch.device("meta"):
        model = build()                  # no memory at all; shapes only
    engine = fz3.initialize(model, torch.optim.AdamW(model.parameters()), cfg)

For each module in turn (named_modules() order) whose own params are on meta: they get real
memory on the device (same Parameter objects: the optimizer and tied params keep them), the
module's `reset_parameters()` fills them, and each is closed at once as under fz3.Init (rank 0's
value broadcast, this rank's shard kept). A rank never holds more than its shards and one
module. The values are each module's default init drawn in that order, not what the model's
own constructor would have done after building its children (nanoGPT's loop, Hugging Face's
post_init): for those values, build under fz3.Init. This is FSDP2's meta-device path, with
the init run for the user.

Refused, naming the module: a meta param whose module has no reset_parameters, and any buffer
on meta (a buffer computed in a constructor, such as a causal mask or rotary frequencies,
cannot be recomputed).
"""
from __future__ import annotations

import torch
from torch import nn

from fz3.build.init import Init


def has_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters()) or any(b.is_meta for b in model.buffers())


def materialize(model: nn.Module, device: torch.device, group=None) -> None:
    """Give every meta param of `model` its shard (see the module doc); every rank calls it."""
    for name, module in model.named_modules():
        for b, buf in module._buffers.items():
            if buf is not None and buf.is_meta:
                raise RuntimeError(f"fz3.initialize: buffer {_qual(name, b)!r} is on the meta device; a "
                                   "buffer cannot be recomputed (its constructor made it): build the "
                                   "model under fz3.Init() instead of torch.device('meta')")
        metas = [(n, p) for n, p in module._parameters.items() if p is not None and p.is_meta]
        if metas and not callable(getattr(module, "reset_parameters", None)):
            raise RuntimeError(f"fz3.initialize: param {_qual(name, metas[0][0])!r} is on the meta device "
                               f"and its module ({type(module).__name__}) has no reset_parameters() to "
                               "initialize it: build the model under fz3.Init() instead")
    closer = Init(group=group)
    closer.join_group()
    done: set[int] = set()
    for module in model.modules():
        metas = [p for p in module._parameters.values() if p is not None and p.is_meta and id(p) not in done]
        if not metas:
            continue
        for p in metas:
            _give_memory(p, device)
        with torch.no_grad():
            module.reset_parameters()
        for p in metas:
            closer.close(p)
            done.add(id(p))


def _give_memory(p: nn.Parameter, device: torch.device) -> None:
    """p's value moves off meta into uninitialized memory, p staying the same object."""
    real = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
    torch.utils.swap_tensors(p, real)
    p.__dict__, real.__dict__ = real.__dict__, p.__dict__  # the attributes stay with p


def _qual(module: str, name: str) -> str:
    return f"{module}.{name}" if module else name
