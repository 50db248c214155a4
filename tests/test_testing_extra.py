"""`fz3.testing` without the test extra: the machines fail naming `fz3[test]`, `gpt` still works.

Hypothesis is hidden in a fresh interpreter by a finder that refuses it, as a machine without
the extra would (the error is the one `import hypothesis` gives there).
"""
from __future__ import annotations

import subprocess
import sys

HIDE = """
import importlib.abc, sys
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] == 'hypothesis':
            raise ModuleNotFoundError("No module named 'hypothesis'", name='hypothesis')
sys.meta_path.insert(0, Hide())
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
