"""Grad partitions: this rank's reduced slice of each param's grad, accumulated over a window.

    reduced slice --write_partition(copy)--> partition      (first write in the window)
    reduced slice --write_partition(add)---> partition + slice   (later writes)
    partition --average(W * gas)--> mean grad --to_master--> fp32 (the optimizer's input)

Pure functions: they return new tensors and never write their inputs (an interpreter that owns
a flat partition buffer may apply the same arithmetic in place).
DeepSpeed: `partition_grads` (copy_ / add_), `_prepare_fp32_grad_for_sub_group` (the cast).
"""
from __future__ import annotations

from typing import Optional

import torch

from fz3.core.effects import WriteMode


def write_partition(partition: Optional[torch.Tensor], reduced: torch.Tensor, mode: WriteMode
                    ) -> torch.Tensor:
    """copy: the reduced slice itself; add: partition + reduced slice."""
    if mode == "copy":
        return reduced
    if mode == "add":
        if partition is None:
            raise ValueError("add into a grad partition that was never written (expected copy)")
        return partition + reduced
    raise ValueError(f"unknown partition write mode {mode!r}; expected 'copy' or 'add'")


def average(partition: torch.Tensor, divisor: int) -> torch.Tensor:
    """Sum -> mean: one division by world_size * gradient_accumulation_steps."""
    return partition / divisor


def to_master(t: torch.Tensor) -> torch.Tensor:
    """Cast to fp32 for the master shards and the optimizer (once, in step)."""
    return t.to(torch.float32)
