"""[Note: huge pages for fresh buffers] (fz3/data/pages.py): fz3's own new CPU buffers of 32 MiB or
more (the pool's, a grad segment's memory each time it comes back) are advised for huge pages
before they are written; smaller ones, and everything with Options(huge_pages=False), are not.
What the kernel was told is read back from /proc/self/smaps: an advised mapping carries the
"hg" VmFlag."""
from __future__ import annotations

import os
import re
import sys

import pytest
import torch
from torch import nn

from fz3.data import pages
from fz3.data.pool import BufferPool
from fz3.data.store import TensorStore
from fz3.launch import run

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(not sys.platform.startswith("linux") or not os.path.exists("/proc/self/smaps")
                                 or not os.path.exists("/sys/kernel/mm/transparent_hugepage"),
                                 reason="Linux with transparent huge pages only")]

CPU = torch.device("cpu")
BIG = pages.MIN_BYTES // 4  # float32 elements: the smallest buffer advised


def advised(t: torch.Tensor) -> bool:
    """Whether the mapping at the first 2 MiB boundary inside t's storage is advised (VmFlags hg)."""
    at = -(-t.untyped_storage().data_ptr() // pages.HUGE_PAGE) * pages.HUGE_PAGE
    with open("/proc/self/smaps") as f:
        blocks = re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", f.read())
    for block in blocks:
        lo, hi = (int(x, 16) for x in block.split(None, 1)[0].split("-"))
        if lo <= at < hi:
            flags = re.search(r"^VmFlags:(.*)$", block, re.M)
            return flags is not None and "hg" in flags.group(1).split()
    raise AssertionError(f"no mapping holds {at:#x}")


def test_a_buffer_of_32_mib_is_advised_and_a_smaller_one_is_not():
    big = torch.empty(BIG)
    assert pages.advise_huge(big) and advised(big)
    small = torch.empty(BIG - 1024)  # glibc maps it alone too, but it might lie in the heap
    assert not pages.advise_huge(small) and not advised(small)
    assert not pages.advise_huge(torch.empty(BIG, device="meta"))
    big.fill_(1.0)  # advised memory is plain memory to write and read
    assert big.sum().item() == BIG


def test_a_fake_tensor_is_not_advised_and_not_asked_for_its_memory():
    """fz3.plan runs the engine on fake tensors: they have no memory to advise, and reading their
    data pointer warns (a UserWarning under every plan of a model with a 32 MiB buffer)."""
    import warnings

    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        fake = torch.empty(BIG)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not pages.advise_huge(fake)


def test_the_pool_advises_the_buffers_it_makes_only_when_asked():
    on = BufferPool(CPU, limit_bytes=1 << 30, huge_pages=True).take(BIG, torch.float32)
    off = BufferPool(CPU, limit_bytes=1 << 30).take(BIG, torch.float32)
    past_limit = BufferPool(CPU, limit_bytes=0, huge_pages=True).take(BIG, torch.float32)  # not kept
    assert advised(on) and not advised(off) and advised(past_limit)


@pytest.mark.parametrize("huge", [True, False])
def test_a_grad_segment_is_advised_each_time_its_memory_comes_back(huge, monkeypatch):
    """Off: fz3 advises nothing (counted: the heap may hand back memory an earlier test advised,
    whose mapping keeps the flag, so smaps cannot tell an unadvised segment apart)."""
    import fz3.data.store as store
    calls = []
    monkeypatch.setattr(store, "advise_huge", lambda t: calls.append(t.numel()) or pages.advise_huge(t))
    n = 2 * BIG  # this rank's shard of it: one 32 MiB segment
    param = nn.Parameter(torch.empty(0).new_empty(n), requires_grad=True)
    s = TensorStore([param], ("w",), [torch.zeros(BIG)], rank=0, world_size=2, compute_dtype="fp32",
                    device=CPU, huge_pages=huge)
    for i in range(2):  # the window's first write, then again after the step gave it back
        s.ensure_partitions()
        if huge:
            assert advised(s.segments[0].grads)
        assert len(calls) == (i + 1 if huge else 0), calls
        s.free_partitions()


def _worker(rank: int, world: int, huge: bool) -> dict:
    import fz3

    torch.manual_seed(0)
    net = nn.Linear(4096, 4096, bias=False)  # 64 MiB full, a 32 MiB shard a rank
    engine = fz3.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1), fz3.Config(),
                            options=fz3.Options(huge_pages=huge))
    loss = engine(torch.randn(2, 4096)).square().sum()
    pooled = [advised(t) for t in engine.interp.buffers_pool.kept()  # the gathered weight, in use
              if t.numel() * t.element_size() >= pages.MIN_BYTES]
    engine.backward(loss)
    segment = advised(engine.store.segments[0].grads)
    engine.step()
    return {"segment": segment, "pooled": pooled}


@pytest.mark.parametrize("huge", [True, False])
def test_the_engine_advises_its_gathers_and_grads_as_options_say(huge):
    for out in run(_worker, world_size=2, args=(huge,), timeout=150, threads=1):
        assert out["segment"] is huge
        assert out["pooled"] and all(a is huge for a in out["pooled"])


def test_options_take_a_bool_only():
    import fz3
    assert fz3.Options().huge_pages is True
    with pytest.raises(TypeError, match="huge_pages must be a bool, got 1"):
        fz3.Options(huge_pages=1)
