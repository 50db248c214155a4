"""The shrunk case `python -m fz3 verify` prints is a pytest test that really runs: written to a
file, pytest fails it while the planted bug is in (the bug's own message) and passes it once the
bug is gone, for a bug of each machine the hunt plants and a layout bug given as a .py file
(fz3/testing/regression.py). And the parse of Hypothesis' printed program, table-driven."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from fz3.testing.planted import PLANTED
from fz3.testing.regression import Draws, program, regression_test
from fz3.testing.verify import verify

PLANT = '''import os
import pytest
from fz3.testing.patch import patched_all


@pytest.fixture(autouse=True)
def plant():
    """The bug of $PLANT (a --patch argument), planted for every test here."""
    with patched_all([os.environ["PLANT"]] if os.environ.get("PLANT") else []):
        yield
'''
SHARD_OFF_BY_ONE = '''from fz3.data.layout import shard_of


def shard_off_by_one(full, rank, world_size):
    return shard_of(full, rank, world_size) + (rank == 1)
'''


def pytest_on(folder, plant: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PLANT"}
    if plant:
        env["PLANT"] = plant
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "."],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=120)


def check_pasted(report, patch: str, caught: str, folder) -> None:
    assert report.failure is not None and report.regression, report.text()
    test = report.regression
    assert test.index("import") < test.index("@replayed\ndef test_"), test  # imports included, one test
    (folder / "conftest.py").write_text(PLANT)
    (folder / "test_pasted.py").write_text(test)
    with_bug = pytest_on(folder, patch)
    assert with_bug.returncode == 1, with_bug.stdout + with_bug.stderr
    assert re.search(caught, with_bug.stdout), with_bug.stdout
    without = pytest_on(folder)
    assert without.returncode == 0 and "1 passed" in without.stdout, without.stdout + without.stderr


@pytest.mark.parametrize("bug, seed", [("release", 0), ("boundary", 0), ("read", 1)])
def test_the_printed_case_fails_with_the_bug_and_passes_without(bug, seed, tmp_path):
    planted = PLANTED[bug]
    report = verify(machines=(planted.machine,), profile="hunt", seed=seed, patches=[planted.patch])
    check_pasted(report, planted.patch, planted.caught, tmp_path)


def test_a_layout_failure_prints_as_a_call_of_its_check(tmp_path):
    (tmp_path / "bugs.py").write_text(SHARD_OFF_BY_ONE)
    patch = f"fz3.data.layout:shard_of={tmp_path / 'bugs.py'}:shard_off_by_one"
    report = verify(machines=("layout",), profile="hunt", seed=0, patches=[patch])
    assert report.patches == ["patched fz3.data.layout.shard_of"], report.patches
    assert "    round_trip(" in report.regression, report.regression
    check_pasted(report, patch, "AssertionError", tmp_path)


@pytest.mark.parametrize("notes, steps", [
    (["Failing test case: <state machine>", "state = M()", "Draw 1 (reached): frozenset({0})", "a note",
      "state.one(data=data(...), k=1)", "state.check()", "state.two(x=2)", "state.teardown()"],
     ["state = M()", "state.one(data=Draws(frozenset({0})), k=1)", "state.check()", "state.two(x=2)",
      "state.teardown()"]),
    (["state = M()", "Draw 1: 3", "Draw 2 (label: with colon): [1,\n 2]", "state.setup(data=data(...))",
      "state.rule(data=data(...))"],  # a rule that drew nothing
     ["state = M()", "state.setup(data=Draws(3, [1,\n 2]))", "state.rule(data=Draws())"]),
    (["state = M()", "Draw 1 (size): 1  # or any other generated value", "state.setup(data=data(...))"],
     ["state = M()", "state.setup(data=Draws(1))"]),  # the explain phase's comment left out
    (["Failing test case: round_trip(\n    n=1,\n)"], None),  # not a state machine
])
def test_the_printed_program_is_read_step_by_step(notes, steps):
    assert program(notes) == steps


def test_a_failure_without_a_printed_case_gives_none():
    assert regression_test(AssertionError("no notes"), name="test_x", where={}) is None


def test_draws_hand_out_the_values_in_order_and_no_more():
    d = Draws(1, "a")
    assert (d.draw(None), d.draw(None)) == (1, "a")
    with pytest.raises(AssertionError, match="draws more"):
        d.draw(None, label="param")
