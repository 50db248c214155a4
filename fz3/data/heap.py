"""glibc's heap thresholds, set once where fz3 trains on CPU.

[Note: heap thresholds] glibc's malloc serves a request of at least its mmap threshold with a
mapping of its own, unmapped when freed, so the next request of that size comes back as fresh
memory and faults in one 4 KiB page at a time. The threshold starts at 128 KiB and is dynamic:
when a mapped buffer larger than it is freed, glibc raises it to that size (at most 32 MiB on
64-bit) and its heap-trim threshold to twice that. DDP frees its 25 MiB bucket buffers when it
rebuilds its buckets after the first step, so from then on its process serves everything below
25 MiB from the heap, and the model's own activations reuse memory. fz3 keeps no buffer that
large on a model this size, so the threshold stays where the model's parameters left it, and
the loss's (batch, seq, vocab) tensors, 8 MiB on the small benchmark GPT, came fresh from the
kernel step after step: 400-2,900 page faults a step on a rank on average, up to 11,000 in one,
2-7 ms of a 170 ms step (bench/RESULTS.md, "glibc's heap thresholds"). The plain model alone in
one process faults the same; it is not fz3's buffers but the heap they all share.

So on CPU, fz3.initialize sets the two thresholds to what glibc's own rule reaches after a
32 MiB buffer is freed: mmap at 32 MiB, trim at 64 MiB (mallopt M_MMAP_THRESHOLD,
M_TRIM_THRESHOLD). Buffers of 32 MiB or more are mapped as before ([Note: huge pages for fresh
buffers], fz3/data/pages.py); smaller ones are reused from the heap, which keeps up to 64 MiB
of free memory at its top instead of giving it back. The peak is what is live at once, as
before; between peaks the process holds that much more, as DDP's does.

It is the process's allocator, so fz3 leaves it as it is where the user chose: any of glibc's
MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, MALLOC_TOP_PAD_ or MALLOC_MMAP_MAX_ in the
environment, or a glibc.malloc tunable in GLIBC_TUNABLES (the benchmarks' memory launches set
MALLOC_MMAP_THRESHOLD_=131072 to see what sharding saves: DESIGN §5). Off with
`fz3.Options(malloc_thresholds=False)`; nothing to do off glibc (another libc, or an allocator
such as jemalloc preloaded, which leaves glibc's malloc unused).
"""
from __future__ import annotations

import ctypes
import os
import platform
import sys
from typing import Mapping, Optional

M_TRIM_THRESHOLD = -1  # <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX, 64-bit)
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD  # what glibc pairs with it when it raises the threshold itself
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def user_choice(environ: Mapping[str, str]) -> Optional[str]:
    """The environment variable by which the user set glibc's heap policy; None: nothing set."""
    for name in USER_SETTINGS:
        if name in environ:
            return name
    if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    return None


def _mallopt():
    """glibc's mallopt from the symbols the interpreter already has; None off Linux with glibc."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    try:
        fn = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


def set_thresholds(environ: Mapping[str, str] = os.environ) -> str:
    """Set glibc's mmap and trim thresholds ([Note: heap thresholds]). -> what was done: "set",
    or why not ("not glibc", "MALLOC_..._ set", "refused"). Setting them again is harmless."""
    chosen = user_choice(environ)
    if chosen is not None:
        return f"{chosen} set"
    mallopt = _mallopt()
    if mallopt is None:
        return "not glibc"
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    return "set" if ok else "refused"
