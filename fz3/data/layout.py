"""Shard layout of one param, as in DeepSpeed: shard = ceil(numel / W), padded with zeros.

    full (any shape, numel n)
      -- flatten, pad with (W - n mod W) mod W zeros -->  flat (W*s,)
      -- view (W, s) -->                                  row r = rank r's shard [r*s, (r+1)*s)
      <-- unshard: concat rows, drop the padding, reshape --

A rank may hold padding only (n < W), and numel 0 gives empty shards (s = 0). All functions are
pure and differentiable, and work under torch.func.vmap. The control plane's integer side of
the same layout is fz3.core.spec (shard_numel, padding).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from fz3.core.spec import shard_numel


def pad_flat(full: torch.Tensor, world_size: int) -> torch.Tensor:
    """(*shape) -> (W*s,): flattened, then zero-padded so it splits evenly into W shards."""
    flat = full.reshape(-1)
    s = shard_numel(flat.numel(), world_size)
    return F.pad(flat, (0, s * world_size - flat.numel()))


def shard(full: torch.Tensor, world_size: int) -> torch.Tensor:
    """(*shape) -> (W, s): every rank's shard, the rank axis first."""
    return pad_flat(full, world_size).reshape(world_size, -1)


def rank_span(numel: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rank's elements [lo, hi) of a flat param of `numel`: [r*s, (r+1)*s) clipped to numel."""
    s = shard_numel(numel, world_size)
    return min(rank * s, numel), min((rank + 1) * s, numel)


def rank_slice(flat: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """(n,) -> (s,): rank's elements [r*s, (r+1)*s) clipped to n, zero-padded to s.

    The one definition of "this rank's part" used by sharding and by the all-reduce path.
    """
    n = flat.shape[-1]
    lo, hi = rank_span(n, rank, world_size)
    return F.pad(flat[..., lo:hi], (0, shard_numel(n, world_size) - (hi - lo)))


def rank_slice_into(flat: torch.Tensor, rank: int, world_size: int, out: torch.Tensor) -> torch.Tensor:
    """`rank_slice` written into a given (s,) buffer (no temporary): -> out."""
    lo, hi = rank_span(flat.numel(), rank, world_size)
    out[:hi - lo].copy_(flat[lo:hi])
    out[hi - lo:].zero_()
    return out


def shard_of(full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """(*shape) -> (s,): rank's shard of a full param."""
    return rank_slice(full.reshape(-1), rank, world_size)


def unshard(shards: torch.Tensor | Sequence[torch.Tensor], shape: Sequence[int]) -> torch.Tensor:
    """(W, s) or W tensors (s,) -> (*shape): concatenate the shards, drop the padding."""
    flat = shards.reshape(-1) if isinstance(shards, torch.Tensor) else torch.cat(list(shards))
    numel = 1
    for d in shape:
        numel *= d
    return flat[:numel].reshape(tuple(shape))
