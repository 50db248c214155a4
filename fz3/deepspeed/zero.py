"""deepspeed.zero: build a model already sharded, and make params whole for a while.

    with deepspeed.zero.Init(): model = build()        # fz3.Init
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0): ...   # fz3.gathered_parameters
"""
from __future__ import annotations

import contextlib

import torch

from fz3.io.consolidate import gathered_parameters
from fz3.build.init import Init as _Init

# zero.Init's arguments that fz3 reads, or that change nothing in fz3 (DeepSpeed 0.19.8
# runtime/zero/partition_parameters.py Init.__init__)
_INIT_UNUSED = ("module", "mem_efficient_linear", "pin_memory", "config_dict_or_path", "config",
                "mpu", "sequence_data_parallel_group", "param_swapper", "zero_param_parallel_group",
                "zero_quantized_weights", "zero_quantized_nontrainable_weights")


def Init(module=None, data_parallel_group=None, mem_efficient_linear: bool = True, remote_device=None,
         pin_memory: bool = False, config_dict_or_path=None, config=None, enabled: bool = True,
         dtype=None, mpu=None, **kwargs) -> _Init:
    """fz3.Init over `data_parallel_group`: modules built inside it are sharded as they are
    built. `remote_device` "cpu"/"nvme" (offload) and a `dtype` other than fp32/bf16 raise;
    `module` (an already-built model to shard) raises: fz3.initialize shards it. The params
    are fp32 shards; fz3.initialize casts to the config's compute dtype.
    DeepSpeed: deepspeed.zero.Init."""
    if module is not None:
        raise ValueError("deepspeed.zero.Init(module=...): fz3 shards a built model in initialize; "
                         "use zero.Init() as a context manager around the model's construction")
    if remote_device not in (None, "none", "cuda"):
        raise ValueError(f"deepspeed.zero.Init(remote_device={remote_device!r}): fz3 keeps params on the "
                         "device (no offload); allowed: None, 'none' or 'cuda' (the device itself)")
    if dtype not in (None, torch.float32, torch.bfloat16):
        raise ValueError(f"deepspeed.zero.Init(dtype={dtype!r}): fz3 keeps fp32 master shards and "
                         "computes in fp32 or bf16; allowed: None, torch.float32, torch.bfloat16")
    unknown = sorted(k for k in kwargs if k not in _INIT_UNUSED)
    if unknown:
        raise TypeError(f"deepspeed.zero.Init got unexpected arguments {unknown}")
    return _Init(enabled=enabled, group=data_parallel_group)


def GatheredParameters(params, modifier_rank=None, fwd_module=None, enabled: bool = True):
    """The params whole inside the block (every rank enters it); with modifier_rank=r, rank r's
    edits become every rank's. enabled=False does nothing. DeepSpeed:
    deepspeed.zero.GatheredParameters (fwd_module registers external params, which fz3 finds
    itself: it is accepted and unused)."""
    if not enabled:
        return contextlib.nullcontext()
    if isinstance(params, torch.nn.Parameter):
        params = [params]
    params = [p for p in params if p is not None]
    return gathered_parameters(params, modifier_rank=modifier_rank)
