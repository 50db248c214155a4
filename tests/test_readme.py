"""The README's "Use" block runs as written: saved as a file and run with python, it trains on
two spawned CPU ranks and prints each rank's last loss."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def use_block() -> str:
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text.split("\n## Use\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.timeout(300)
def test_the_readme_use_block_runs_as_written(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(use_block())
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path,
                         env={**os.environ, "FZ3_DEVICE": "cpu"})
    assert out.returncode == 0, out.stderr[-3000:]
    losses = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    assert len(losses) == 2 and all(0 < loss < 1 for loss in losses), losses
