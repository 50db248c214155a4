"""The import paths of the modules that moved into folders in reading order (issue #26 point 5)
keep working: each old name gives the very module at its new place (fz3/moved.py)."""
from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import fz3
from fz3.moved import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_is_the_new_module(old):
    assert importlib.import_module(old) is importlib.import_module(MOVED[old])


def test_the_table_points_at_real_modules_only():
    for old, new in MOVED.items():
        assert importlib.util.find_spec(new) is not None, new
        parent = old.rsplit(".", 1)[0]
        assert importlib.util.find_spec(parent) is not None, parent  # the old parent package is still there


def test_names_users_write_through_old_paths_are_the_same_objects():
    """In a fresh interpreter, old paths first: one class, one registry."""
    code = ("from fz3.shell.checkpoint import CheckpointError as A\n"
            "from fz3.io.checkpoint import CheckpointError as B\n"
            "from fz3.core.state import Txn\nimport fz3.core.param.state as s\n"
            "from fz3.shell.api import initialize\nimport fz3\n"
            "assert A is B and Txn is s.Txn and initialize is fz3.initialize\nprint('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "ok", r.stderr[-2000:]


def test_an_unknown_old_name_still_fails():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("fz3.shell.no_such_module")
    assert fz3.moved.MovedFinder().find_spec("fz3.shell.no_such_module") is None


def test_a_pickle_made_under_an_old_name_loads():
    """A pickle names a class by its module: one saved before the move names the old one."""
    import pickle
    from fz3.io.checkpoint import CheckpointError
    assert pickle.loads(b"cfz3.shell.checkpoint\nCheckpointError\n.") is CheckpointError
