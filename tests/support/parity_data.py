"""What every parity model shares: the global micro-batch size, the model record, rank slicing,
seeded generators, and the regression data and loss most models use."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

GLOBAL_BATCH = 6  # per micro-step, over all ranks: divisible by 1, 2 and 3


@dataclass(frozen=True)
class ParityModel:
    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[int], tuple]
    loss: Callable[[Callable, tuple, int], torch.Tensor]
    leaf_classes: tuple = field(default=())


def _gen(i: int, salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 * salt + i)


def rank_slice(batch: tuple, rank: int, world_size: int) -> tuple:
    """Rank r's micro-batch: rows [r*b, (r+1)*b) of every tensor, b = GLOBAL_BATCH / W."""
    if GLOBAL_BATCH % world_size:
        raise ValueError(f"world size {world_size} does not divide the global batch {GLOBAL_BATCH}")
    b = GLOBAL_BATCH // world_size
    return tuple(t[rank * b:(rank + 1) * b] for t in batch)


def _regression_batch(salt: int, n_in: int, n_out: int):
    def batch(i: int) -> tuple:
        g = _gen(i, salt)
        return torch.randn(GLOBAL_BATCH, n_in, generator=g), torch.randn(GLOBAL_BATCH, n_out, generator=g)
    return batch


def _mse(m, b: tuple, i: int) -> torch.Tensor:
    x, y = b
    return ((m(x).float() - y) ** 2).mean()
