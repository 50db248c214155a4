"""I6 across processes: the core emits the same effects, in the same order, on ranks that are
processes with different hash seeds (tests/support/effect_streams.py, 40 drawn cases each), and a
core that iterates a set of names (planted) is caught."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = 40


def streams(seed: int, *extra: str) -> list[str]:
    env = dict(os.environ, PYTHONHASHSEED=str(seed))
    out = subprocess.run([sys.executable, "-m", "tests.support.effect_streams", str(CASES), *extra],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def test_two_processes_with_different_hash_seeds_emit_the_same_effects():
    a, b = streams(1), streams(2)
    assert len(a) == CASES and len(set(a)) > CASES // 2  # drawn cases, not one case 40 times
    assert a == b, [i for i, (x, y) in enumerate(zip(a, b)) if x != y]


def test_a_core_iterating_a_set_of_names_is_caught():
    a, b = streams(1, "--plant", "names"), streams(2, "--plant", "names")
    assert a != b
