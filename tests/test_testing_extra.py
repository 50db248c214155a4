"""`fz3.testing` without the test extra: the machines raise a plain ImportError naming it, the
package itself imports, and nothing is installed on the import system to say so (fz3/testing/extra.py).

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
    for module in ("fz3.testing.param_machine", "fz3.testing.verify", "fz3.testing.models"):
        r = run(f"import {module}")
        assert r.returncode != 0
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith("ImportError: fz3.testing's machines need Hypothesis, which is not installed: install "
                               "fz3's test extra (pip install -e '.[test]' in your clone of fz3)"), r.stderr


def test_the_package_needs_no_hypothesis_and_nothing_is_installed_on_the_import_system():
    r = run("import sys; before = list(sys.meta_path)\n"
            "import fz3.testing; print(fz3.testing.__name__)\n"
            "try:\n    import fz3.testing.param_machine\nexcept ImportError:\n    pass\n"
            "print(sys.meta_path == before)")
    assert r.returncode == 0 and r.stdout.split() == ["fz3.testing", "True"], r.stderr


def test_others_asking_for_hypothesis_are_told_it_is_missing():
    """torch._dynamo probes find_spec("hypothesis") for its skip list when it is first imported
    (torch.compile): after fz3.testing it gets None, as without fz3."""
    r = run("import fz3.testing, importlib.util, torch._dynamo; "
            "print(importlib.util.find_spec('hypothesis'))")
    assert r.returncode == 0 and r.stdout.strip() == "None", r.stderr
