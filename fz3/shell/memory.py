"""What an engine holds in memory, by kind: the `engine.stats()` memory keys.

    param_shards, grad_partitions   this rank's fp32 masters (+ compute shards) and grad
                                    partitions (TensorStore.shard_bytes)
    gathered_param_bytes            full params live now (live numel x compute element size)
    peak_gathered_param_bytes       the most ever live (peak live numel)
    optimizer_state_bytes           tensors of optimizer.state (exp_avg, exp_avg_sq, step, ...)
    buffer_bytes                    the model's buffers
    reduce_buffer_bytes             IPG bucket buffers (the interpreter)
    pool_bytes                      the interpreter's flat collective buffers kept for reuse;
                                    timing decides it by a buffer or so (a transport thread that
                                    lets go of a finished work after the wait returned)
    device_allocated_bytes          the device's allocated bytes now (CPU: resident set size)
    device_peak_bytes               ... and their peak (CPU: peak RSS, VmHWM)

ZeRO-3 exists to save memory, so what fz3 holds is reported by kind, beside what the device
says; a tensor shared by two entries (a view) is counted once within each kind.
DeepSpeed: see_memory_usage / estimate_zero3_model_states_mem_needs_all_live (by kind, not live).
"""
from __future__ import annotations

from typing import Iterable

import torch


def memory_stats(engine) -> dict[str, int]:
    st, store = engine.params_state, engine.store
    size = torch.empty(0, dtype=store.dtype).element_size()
    state_tensors = (v for s in engine.optimizer.state.values() for v in s.values()
                     if isinstance(v, torch.Tensor))
    return {
        **store.shard_bytes(),
        "gathered_param_bytes": st.live_numel * size,
        "peak_gathered_param_bytes": st.peak_live_numel * size,
        "optimizer_state_bytes": tensor_bytes(state_tensors),
        "buffer_bytes": tensor_bytes(engine.module.buffers()),
        "reduce_buffer_bytes": engine.interp.bucket_bytes(),
        "held_grad_bytes": engine.interp.held_bytes,
        "peak_held_grad_bytes": engine.interp.peak_held_bytes,
        "secondary_param_bytes": engine.interp.secondary_bytes,  # hpZ ([Note: hpZ], fz3/core/stage.py)
        "peak_secondary_param_bytes": engine.interp.peak_secondary_bytes,
        "pool_bytes": engine.interp.pool_bytes(),
        "device_allocated_bytes": engine.accelerator.memory_allocated(),
        "device_peak_bytes": engine.accelerator.max_memory_allocated(),
    }


def human_bytes(n: int) -> str:
    """1.23 GiB, 4.50 MiB, 12.00 KiB or 7 B."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (a view counts its storage once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage._cdata] = storage.nbytes()  # the storage itself: meta tensors have no data_ptr
    return sum(seen.values())
