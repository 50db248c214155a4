"""Huge pages for fz3's own large CPU buffers.

[Note: huge pages for fresh buffers] fz3 gives memory back between uses, where DDP keeps its
buffers for good: a gathered param's buffer goes at the end of the pass that used it, a grad
segment at the optimizer step (fz3/data/pool.py, fz3/data/store.py). So every step writes some
large buffers into fresh memory, and on Linux fresh memory comes one 4 KiB page fault at a time:
8,192 faults for 32 MiB, each a trip into the kernel. Advising the kernel to back a buffer
with 2 MiB pages (madvise MADV_HUGEPAGE, honoured where transparent huge pages are "madvise" or
"always") takes 512 times fewer faults for the same bytes. On the wide benchmark GPT the faults
were 16 K in each forward and 67 K in each backward (`bench/RESULTS.md`, "Huge pages for fz3's
buffers"); the advice took the step from about DDP's time to 0.83-0.86 of it.

Only buffers of at least `MIN_BYTES` (32 MiB) are advised: glibc's malloc never serves one that
large from its heap (its mmap threshold tops out at 32 MiB on 64-bit), so each is a mapping of
its own, unmapped when freed, and the advice goes with it. A smaller buffer may lie in the heap,
whose pages outlive it: advised, they would hand later small allocations 2 MiB pages. Only the
2 MiB-aligned interior of a buffer is advised, so no huge page reaches past it and the resident
memory of a buffer written whole stays what it was. One written in part (a reduce's scratch is cut
from one buffer sized for the largest bucket: [Note: one size per reduce buffer]) is resident up
to the next 2 MiB boundary past what was written; the kernel's khugepaged may fill in more of an
advised range that lives long, but these buffers live for a pass at most.

Off with `fz3.Options(huge_pages=False)`, e.g. where the kernel's direct compaction for advised
memory (`/sys/kernel/mm/transparent_hugepage/defrag`) stalls a fragmented machine.
"""
from __future__ import annotations

import ctypes
import sys

import torch
from torch._subclasses.fake_tensor import is_fake

MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux
HUGE_PAGE = 2 << 20
MIN_BYTES = 32 << 20  # glibc's largest mmap threshold (DEFAULT_MMAP_THRESHOLD_MAX, 64-bit)


def _madvise():
    """libc's madvise, from the symbols the interpreter already has (no library search at
    import: ctypes.util.find_library runs ldconfig); None off Linux or where it is missing."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _madvise()


def advise_huge(t: torch.Tensor) -> bool:
    """Ask for huge pages behind `t`'s storage, before it is written: [Note: huge pages for
    fresh buffers]. -> whether the kernel took the advice (False: not CPU, below MIN_BYTES, a
    fake tensor, not Linux, or the kernel refused it). Never changes `t`."""
    if _MADVISE is None or t.device.type != "cpu":
        return False
    storage = t.untyped_storage()
    size = storage.nbytes()
    if size < MIN_BYTES or is_fake(t):  # fz3.plan's fake tensors have no memory (and warn when asked)
        return False
    ptr = storage.data_ptr()
    if not ptr:
        return False
    lo = -(-ptr // HUGE_PAGE) * HUGE_PAGE
    hi = (ptr + size) // HUGE_PAGE * HUGE_PAGE
    return hi > lo and _MADVISE(lo, hi - lo, MADV_HUGEPAGE) == 0
