"""What the install gives: the README's first command installs fz3's runtime dependencies only,
and those must make a clean first run (issue #23 point 8)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def runtime_dependencies() -> list[str]:
    text = open(os.path.join(ROOT, "pyproject.toml")).read()
    block = re.search(r"^dependencies = \[(.*?)\]", text, re.M | re.S).group(1)
    return [re.match(r"[A-Za-z0-9_.-]+", d).group(0).lower() for d in re.findall(r'"([^"]+)"', block)]


def test_numpy_is_installed_with_fz3():
    """torch imports without numpy but warns (UserWarning: Failed to initialize NumPy: No module
    named 'numpy', once per process: three times on the README's main job), so fz3's own
    install must bring it."""
    assert "numpy" in runtime_dependencies()


def test_importing_fz3s_engine_warns_nothing():
    out = subprocess.run([sys.executable, "-W", "error", "-c", "import fz3.api, fz3.launch"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and out.stderr == "", out.stderr[-2000:]
