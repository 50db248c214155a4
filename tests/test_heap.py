"""[Note: heap thresholds] (fz3/data/heap.py): fz3.launch.run(malloc_thresholds=True) starts its
ranks with glibc's mmap threshold at 32 MiB and its trim threshold at 64 MiB, through glibc's
MALLOC_* variables, unless the environment sets glibc's heap policy; by default, and in
fz3.initialize always, the process's allocator is left alone (a library leaves the process as it found it).

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


def test_the_ranks_environment_serves_buffers_below_32_mib_from_the_heap():
    env = heap.rank_environment({})
    assert env == {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(64 << 20)}
    seen = probe("", **env)
    assert seen["fresh 8 MiB"] is False and seen["8 MiB"] is False and seen["31 MiB"] is False
    assert seen["32 MiB"]  # still a mapping of its own: huge pages advise it (fz3/data/pages.py)
    assert probe("")["fresh 8 MiB"] is True  # glibc's own threshold starts at 128 KiB


LAUNCHED = textwrap.dedent("""
    import json, os, fz3.launch
    def rank(rank, world):
        return {k: os.environ.get(k) for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")}
    if __name__ == "__main__":
        before = dict(os.environ)
        out = fz3.launch.run(rank, world_size=2, timeout=120, **json.loads(os.environ["ASKED"]))
        print(json.dumps({"ranks": out, "parent_unchanged": dict(os.environ) == before}))
""")


def _launched(tmp_path, asked: dict, **env: str) -> dict:
    script = tmp_path / "launched.py"  # spawned ranks import the main module: a file, not -c
    script.write_text(LAUNCHED)
    clean = {k: v for k, v in os.environ.items() if heap.user_choice({k: v}) is None}
    out = subprocess.run([sys.executable, str(script)], env={**clean, **env, "FZ3_DEVICE": "cpu",
                                                             "ASKED": json.dumps(asked)},
                         capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_launch_starts_its_ranks_with_the_thresholds_when_asked_and_puts_its_own_environment_back(tmp_path):
    seen = _launched(tmp_path, {"malloc_thresholds": True})
    assert seen["ranks"] == [heap.rank_environment({})] * 2
    assert seen["parent_unchanged"]


def test_launch_leaves_the_ranks_allocator_alone_by_default(tmp_path):
    seen = _launched(tmp_path, {})
    assert seen["ranks"] == [{"MALLOC_MMAP_THRESHOLD_": None, "MALLOC_TRIM_THRESHOLD_": None}] * 2


def test_initialize_never_touches_the_process_allocator():
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
def test_the_users_own_heap_settings_are_left_alone(tmp_path, name, value):
    assert heap.rank_environment({name: value}) == {}
    seen = _launched(tmp_path, {"malloc_thresholds": True}, **{name: value})
    assert seen["ranks"][0] == {k: (value if k == name else None)
                                for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")}


def test_user_choice_names_the_setting():
    assert heap.user_choice({}) is None
    assert heap.user_choice({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"}) is None
    assert heap.user_choice({"MALLOC_TRIM_THRESHOLD_": "1"}) == "MALLOC_TRIM_THRESHOLD_"
    assert heap.user_choice({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1"}) == "GLIBC_TUNABLES"


def test_the_launch_switch_is_a_bool():
    import fz3.launch
    with pytest.raises(TypeError, match="malloc_thresholds must be a bool, got 'yes'"):
        fz3.launch.run(print, world_size=1, malloc_thresholds="yes")
