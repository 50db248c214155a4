"""glibc's heap thresholds for the CPU ranks fz3.launch spawns, when asked.

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

So the ranks that fz3.launch.run spawns can be started, when asked
(`fz3.launch.run(..., malloc_thresholds=True)`), with the two thresholds where glibc's own rule
takes them after a 32 MiB buffer is freed: mmap at 32 MiB, trim at 64 MiB, through glibc's
documented environment variables MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_, which a
fresh interpreter's malloc reads when it starts. Buffers of 32 MiB or more are mapped as before
([Note: huge pages for fresh buffers], fz3/data/pages.py); smaller ones are reused from the
heap, which keeps up to 64 MiB of free memory at its top instead of giving it back. The peak is
what is live at once, as before; between peaks the process holds that much more, as DDP's does.
Under torchrun, set the same two variables in the rank's environment.

The allocator is the whole process's, so fz3 never changes it in a running process (no mallopt
from fz3.initialize: a library leaves the process as it found it), and leaves the ranks' environment as it is where the
user chose: any of glibc's MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, MALLOC_TOP_PAD_ or
MALLOC_MMAP_MAX_ in the environment, or a glibc.malloc tunable in GLIBC_TUNABLES (the
benchmarks' memory launches set MALLOC_MMAP_THRESHOLD_=131072 to see what sharding saves:
docs/environment.md). Off glibc (another libc, or an allocator such as jemalloc preloaded) the variables
mean nothing and none is set.
"""
from __future__ import annotations

import os
import platform
import sys
from typing import Mapping, Optional

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


def rank_environment(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The variables to add to a spawned rank's environment for [Note: heap thresholds]: both
    thresholds; nothing where the user set glibc's heap policy or the libc is not glibc."""
    if user_choice(environ) is not None or not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return {}
    return {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}
