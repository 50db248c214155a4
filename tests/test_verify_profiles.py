"""The Hypothesis profiles of fz3/testing/profiles.py: property_tests/conftest.py registers them, so
pytest loads `hunt` by --hypothesis-profile=hunt or HYPOTHESIS_PROFILE=hunt; importing the module
registers nothing (no process-wide side effect); and bench/diagnostics/hunt.py prints its table (one bug, one run)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUT = "property_tests/test_layout_properties.py"


def run(args: list[str], **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("HYPOTHESIS_PROFILE", "FZ3_HYPOTHESIS_PROFILE", "CI")}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env={**clean, **env}, capture_output=True, text=True,
                          timeout=240)


@pytest.mark.parametrize("how", ["option", "environment", "fz3's environment variable"])
def test_pytest_loads_the_hunt_profile(how):
    args = ["-m", "pytest", "--collect-only", "-v", "-p", "no:cacheprovider", "-o", "addopts=", LAYOUT]
    env = {"option": {}, "environment": {"HYPOTHESIS_PROFILE": "hunt"},
           "fz3's environment variable": {"FZ3_HYPOTHESIS_PROFILE": "hunt"}}[how]
    got = run(args + (["--hypothesis-profile=hunt"] if how == "option" else []), **env)
    assert got.returncode == 0, got.stdout + got.stderr
    assert re.search(r"^hypothesis profile 'hunt' -> .*max_examples=300, stateful_step_count=8", got.stdout,
                     re.M), got.stdout  # Hypothesis' own header line (-v)


def test_without_a_choice_pytest_runs_dev():
    got = run(["-m", "pytest", "--collect-only", "-v", "-p", "no:cacheprovider", "-o", "addopts=", LAYOUT])
    assert re.search(r"^hypothesis profile 'dev' -> ", got.stdout, re.M), got.stdout


def test_importing_the_profiles_registers_none():
    got = run(["-c", "import fz3.testing.profiles as p\nfrom hypothesis import settings\n"
                     "try:\n    settings.get_profile('hunt')\nexcept Exception as e:\n    print(type(e).__name__)\n"
                     "p.register(); print(settings.get_profile('hunt').stateful_step_count)"])
    assert got.stdout.split() == ["InvalidArgument", "8"], got.stdout + got.stderr


def test_the_hunt_bench_prints_its_table():
    got = run(["bench/diagnostics/hunt.py", "--runs", "1", "--bugs", "boundary"])
    assert got.returncode == 0, got.stdout + got.stderr
    rows = [line for line in got.stdout.splitlines() if line.startswith("| boundary")]
    assert len(rows) == 1, got.stdout
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[:2] == ["boundary: fz3.core.grad.grads:flush_waiting (grad lifecycle)", "GradMachine"], cells
    assert 0 < float(cells[2]) and 0 < float(cells[3]) < 60 and int(cells[4]) >= 1, cells  # the hunt's promise
