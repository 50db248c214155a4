"""The teaching examples run alone, in one process, and print what they claim to show
(examples/01_func_spec.py, 02_effect_log.py, 03_grad_buckets.py, 04_simulated_engine.py,
05_plan.py, 06_timeline.py, 07_check.py;
issue #12's reading path)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPECT = {
    "01_func_spec.py": "partitions equal fz3.func's mean grads: True",
    "02_effect_log.py": "after the optimizer step only persistent params are live",
    "03_grad_buckets.py": "every partition equals its slice of the mean gradient, bit for bit",
    "04_simulated_engine.py": "matches single-process training: True",
    "05_plan.py": "on 64 ranks",
    "06_timeline.py": "wrote /tmp/fz3_run.json",
    "07_check.py": "the smallest failing example: 1 rank(s), 1 step(s), fz3.Config(param_persistence_threshold=",
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(EXPECT))
def test_example_runs_alone(name):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", name)], capture_output=True,
                         text=True, timeout=100, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert EXPECT[name] in out.stdout
