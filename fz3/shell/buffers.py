"""Buffers agree across ranks: rank 0's are broadcast, as DDP's `broadcast_buffers=True` does.

    fz3.Options(broadcast_buffers=True)   (the default) before every forward pass (training or
                                          not, grad or not), before full_state_dict() and before
                                          a checkpoint save
    fz3.Options(broadcast_buffers=False)  each rank keeps its own (full_state_dict() returns
                                          this rank's, a checkpoint rank 0's)

A buffer is a module's state that is not a parameter: BatchNorm's running mean and variance and
its batch count, a rotary embedding's frequencies, a causal mask. fz3 does not shard them; each
rank holds them whole. A forward updates some of them from the rank's own micro-batch
(BatchNorm in train mode), so without a broadcast they drift apart: 6.7e-2 after a few steps of
a BatchNorm model on 2 ranks, and an eval pass, the consolidated weights and a checkpoint then
depend on the rank. DDP broadcasts rank 0's buffers before each training forward; fz3 does it
before eval passes too (they read the buffers), and before the weights leave the engine.

Cost: one broadcast of all the buffers' bytes, every dtype in one flat byte buffer (a copy in and
one out when there are several), checked by the divergence check like every collective (on
gloo its descriptors travel beside the data: one round trip). A model without buffers (the
benchmark GPTs) does nothing at all, nor does a world of one rank (bench/RESULTS.md, "Buffers
broadcast": a broadcast per dtype, each checked first, cost a BatchNorm MLP 10 % of its step). Buffers are looked up by (module, name) at each sync,
so one a model replaces (`self.inv_freq = ...`) is the new tensor. DeepSpeed ZeRO-3 leaves
buffers per rank; FSDP2 too.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn


class BufferSync:
    """Every rank's buffers become rank 0's, all at once: `sync()`."""

    def __init__(self, model: nn.Module, broadcast: Callable[[torch.Tensor], None], *, enabled: bool,
                 world_size: int) -> None:
        """`broadcast(t)`: every rank's `t` becomes rank 0's (the interpreter's, checked)."""
        self.broadcast = broadcast
        self.slots: list[tuple[nn.Module, str]] = []
        if enabled and world_size > 1:
            self.slots = [(m, name) for m in model.modules() for name, b in m._buffers.items() if b is not None]

    def sync(self) -> None:
        """Broadcast rank 0's buffers: one flat broadcast of their bytes per device."""
        if not self.slots:
            return
        groups: dict[torch.device, list[torch.Tensor]] = {}
        seen: set[int] = set()
        for m, name in self.slots:
            b = m._buffers.get(name)
            if b is not None and id(b) not in seen:  # a buffer registered twice moves once
                seen.add(id(b))
                groups.setdefault(b.device, []).append(b)
        with torch.no_grad():
            for bufs in groups.values():
                _broadcast_bytes(bufs, self.broadcast)


def _broadcast_bytes(bufs: list[torch.Tensor], broadcast: Callable[[torch.Tensor], None]) -> None:
    """Every dtype in one uint8 buffer: one message, whatever the model keeps."""
    if len(bufs) == 1 and bufs[0].is_contiguous():
        broadcast(bufs[0])
        return
    flat = torch.cat([b.contiguous().view(-1).view(torch.uint8) for b in bufs])  # (total bytes,)
    broadcast(flat)
    sizes = [b.numel() * b.element_size() for b in bufs]
    for b, piece in zip(bufs, flat.split(sizes)):
        if b.is_contiguous():  # into its own bytes: a piece need not start where b's dtype aligns
            b.view(-1).view(torch.uint8).copy_(piece)
        else:
            b.copy_(piece.clone().view(b.dtype).view_as(b))
