"""[Note: heap thresholds] (fz3/data/heap.py): on CPU, fz3.initialize sets glibc's mmap threshold
to 32 MiB and its trim threshold to 64 MiB when Options(malloc_thresholds=True) asks for it, unless
the environment sets glibc's heap policy; by default it leaves the process's allocator alone
(STYLE.md rule 15).

What glibc decided is read back from the chunk header in front of a buffer: the size word's
IS_MMAPPED bit (0x2) is set where malloc gave the buffer a mapping of its own. Each case runs in
a fresh interpreter, since the thresholds are the process's and the dynamic rule moves them."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap

import pytest

from fz3.data import heap

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                                 reason="glibc's malloc only")]

PROBE = textwrap.dedent("""
    import ctypes, json, sys
    import torch

    held = []  # none freed: freeing a mapped buffer raises glibc's dynamic threshold to its size

    def mapped(numel):
        t = torch.empty(numel)  # float32
        held.append(t)
        return bool(ctypes.c_size_t.from_address(t.untyped_storage().data_ptr() - 8).value & 2)

    MiB = 1 << 18  # float32 elements
    seen = {"fresh 8 MiB": mapped(8 * MiB)}
    exec(sys.argv[1])
    seen.update({"8 MiB": mapped(8 * MiB), "31 MiB": mapped(31 * MiB), "32 MiB": mapped(32 * MiB)})
    print(json.dumps(seen))
""")


def probe(code: str, **env: str) -> dict:
    """Run `code` in a fresh interpreter between two looks at which buffers glibc maps alone."""
    clean = {k: v for k, v in os.environ.items() if heap.user_choice({k: v}) is None}
    out = subprocess.run([sys.executable, "-c", PROBE, code], env={**clean, **env}, capture_output=True,
                         text=True, timeout=150)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_set_thresholds_serves_buffers_below_32_mib_from_the_heap():
    seen = probe("from fz3.data import heap; seen['did'] = heap.set_thresholds()")
    assert seen["did"] == "set"
    assert seen["fresh 8 MiB"]  # glibc's own threshold starts at 128 KiB
    assert not seen["8 MiB"] and not seen["31 MiB"]
    assert seen["32 MiB"]  # still a mapping of its own: huge pages advise it (fz3/data/pages.py)


def test_initialize_sets_them_on_cpu_when_asked():
    code = textwrap.dedent("""
        import fz3, fz3.launch, torch
        def rank(rank, world):
            net = torch.nn.Linear(4, 4)
            fz3.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1), fz3.Config(),
                           options=fz3.Options(malloc_thresholds=True))
        fz3.launch.run_threads(rank, world_size=1)
    """)
    assert probe(code)["8 MiB"] is False


def test_initialize_leaves_the_process_allocator_alone_by_default():
    code = textwrap.dedent("""
        import fz3, fz3.launch, torch
        def rank(rank, world):
            net = torch.nn.Linear(4, 4)
            fz3.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1), fz3.Config())
        fz3.launch.run_threads(rank, world_size=1)
    """)
    assert probe(code)["8 MiB"] is True


@pytest.mark.parametrize("name, value", [("MALLOC_MMAP_THRESHOLD_", "131072"), ("MALLOC_TOP_PAD_", "0"),
                                         ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=131072")])
def test_the_users_own_heap_settings_are_left_alone(name, value):
    seen = probe("from fz3.data import heap; seen['did'] = heap.set_thresholds()", **{name: value})
    assert seen["did"] == f"{name} set"
    assert seen["8 MiB"] is True  # glibc's, as the environment left it


def test_user_choice_names_the_setting():
    assert heap.user_choice({}) is None
    assert heap.user_choice({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"}) is None
    assert heap.user_choice({"MALLOC_TRIM_THRESHOLD_": "1"}) == "MALLOC_TRIM_THRESHOLD_"
    assert heap.user_choice({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1"}) == "GLIBC_TUNABLES"


def test_the_option_is_a_bool():
    import fz3
    with pytest.raises(TypeError, match="malloc_thresholds"):
        fz3.Options(malloc_thresholds="yes")
