"""`fz3.testing` without the test extra: the machines fail naming `fz3[test]`, `gpt` still works.

Hypothesis is hidden in a fresh interpreter by making the path finder not find it, as on a
machine without the extra (`import hypothesis` fails with "No module named", and
`importlib.util.find_spec("hypothesis")` is None).
"""
from __future__ import annotations

import subprocess
import sys

HIDE = """
import importlib.machinery
_find = importlib.machinery.PathFinder.find_spec
def _hidden(name, path=None, target=None):
    return None if name.split('.')[0] == 'hypothesis' else _find(name, path, target)
importlib.machinery.PathFinder.find_spec = staticmethod(_hidden)
"""


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", HIDE + code], capture_output=True, text=True, timeout=120)


def test_a_machine_without_hypothesis_names_the_extra():
    r = run("import fz3.testing.param_machine")
    assert r.returncode != 0
    assert "pip install 'fz3[test]'" in r.stderr and "ModuleNotFoundError" in r.stderr, r.stderr


def test_gpt_needs_no_hypothesis():
    r = run("from fz3.testing.gpt import GPT, GPTConfig; print(type(GPT(GPTConfig())).__name__)")
    assert r.returncode == 0 and r.stdout.strip() == "GPT", r.stderr


def test_the_hidden_import_fails_without_the_message_unless_fz3_testing_was_imported():
    """The finder is what gives the message (so the first test would fail without it)."""
    r = run("import hypothesis")
    assert r.returncode != 0 and "fz3[test]" not in r.stderr


def test_others_asking_for_hypothesis_are_told_it_is_missing():
    """torch._dynamo probes find_spec("hypothesis") for its skip list when it is first imported
    (torch.compile): after fz3.testing it must get None, not the machines' error."""
    r = run("import fz3.testing.gpt, importlib.util, torch._dynamo; "
            "print(importlib.util.find_spec('hypothesis'))")
    assert r.returncode == 0 and r.stdout.strip() == "None", r.stderr
