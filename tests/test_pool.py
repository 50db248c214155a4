"""The buffer pool (fz3/data/pool.py): a buffer is handed out again only once nothing but the
pool holds its storage, and the pool keeps at most its byte limit."""
from __future__ import annotations

import torch

from fz3.data.pool import BufferPool

CPU = torch.device("cpu")


def ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_reused_only_when_every_reference_is_gone():
    pool = BufferPool(CPU, limit_bytes=1 << 20)
    a = pool.take(16, torch.float32)
    first, view = ptr(a), a[4:8]  # the view: e.g. a param's .data, or a tensor autograd saved
    del a
    b = pool.take(16, torch.float32)
    assert ptr(b) != first  # still referenced through the view: a new buffer
    del view
    c = pool.take(16, torch.float32)
    assert ptr(c) == first and pool.misses == 2 and pool.hits == 1
    assert pool.take(16, torch.bfloat16).dtype == torch.bfloat16  # dtype is part of the key
    assert pool.take(8, torch.float32).shape == (8,)


def test_byte_limit_evicts_free_buffers_least_recently_used_first():
    pool = BufferPool(CPU, limit_bytes=100 * 4)
    pool.take(40, torch.float32)  # free at once (nothing keeps it)
    pool.take(50, torch.float32)
    assert pool.bytes == 90 * 4
    held = pool.take(30, torch.float32)  # needs room: the 40 goes (least recently used)
    assert pool.bytes == 80 * 4 and (40, torch.float32) not in pool.buffers
    big = pool.take(200, torch.float32)  # can never fit: handed out untracked
    assert pool.bytes == 80 * 4 and big.numel() == 200 and held.numel() == 30
    assert ptr(pool.take(30, torch.float32)) != ptr(held)  # the 30 is in use: not handed out twice


def test_no_room_means_plain_allocations():
    """limit 0 (the interpreter's choice on an accelerator): nothing is kept, nothing reused."""
    pool = BufferPool(CPU, limit_bytes=0)
    pool.take(1024, torch.float32)
    assert pool.bytes == 0 and not pool.buffers and pool.misses == 1
    pool.take(1024, torch.float32)
    assert pool.hits == 0 and pool.misses == 2
