"""fz3.core is the control plane: it never imports torch (or anything that pulls it in).

Checked twice: every fz3.core module imports in a fresh interpreter where importing torch
raises (fz3/__init__.py, which loads the torch shell, is skipped), and no source file under
fz3/core names torch in an import.
"""
from __future__ import annotations

import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import fz3.core

CORE = Path(fz3.core.__file__).parent


def core_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages([str(CORE)], prefix="fz3.core."))


def test_there_is_a_core_to_check():
    assert {"fz3.core.param.fetch", "fz3.core.param.release", "fz3.core.param.state"} <= set(core_modules())


ISOLATED = """
import importlib, importlib.abc, sys, types
class Refuse(importlib.abc.MetaPathFinder):  # importing torch from the core fails loudly
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "numpy"):
            raise ImportError(f"fz3.core imported {name}")
sys.meta_path.insert(0, Refuse())
pkg = types.ModuleType("fz3")  # skip fz3/__init__.py, which loads the torch shell
pkg.__path__ = [%r]
sys.modules["fz3"] = pkg
for name in %r:
    importlib.import_module(name)
print(sorted({m.split(".")[0] for m in sys.modules} & {"torch", "numpy"}))
"""


def test_importing_the_core_does_not_import_torch():
    code = ISOLATED % (str(CORE.parent), core_modules())
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


IMPORT_TORCH = re.compile(r"^\s*(import\s+torch\b|from\s+torch\b)", re.MULTILINE)


def test_no_core_source_imports_torch():
    offenders = [p.name for p in sorted(CORE.rglob("*.py")) if IMPORT_TORCH.search(p.read_text())]
    assert offenders == []
