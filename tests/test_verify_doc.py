"""docs/verify.md runs as written: each ```python block in a fresh interpreter (outside the
repository, so nothing is written into it), the regression test it shows also failing with the
planted bug it was shrunk from, and each `$ ` command of its ```console blocks, exit status 1
with FAILED where it plants a bug, else 0."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "verify.md")
pytestmark = pytest.mark.timeout(300)


def blocks(kind: str) -> list[str]:
    with open(DOC) as f:
        return re.findall(rf"^```{kind}\n(.*?)^```$", f.read(), re.M | re.S)


def python(code: str, cwd) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=240)


def commands() -> list[str]:
    return [line[2:] for block in blocks("console") for line in block.splitlines() if line.startswith("$ ")]


def test_the_doc_has_blocks_to_run():
    assert len(blocks("python")) >= 4 and len(commands()) >= 3


@pytest.mark.parametrize("i", range(len(blocks("python"))))
def test_each_python_block_runs(i, tmp_path):
    got = python(blocks("python")[i], tmp_path)
    assert got.returncode == 0, got.stdout + got.stderr


def test_the_regression_test_shown_fails_with_its_bug(tmp_path):
    """The pasted test of section 5 passes above; with the bug it was shrunk from, it fails."""
    from fz3.testing.planted import PLANTED
    shown = next(b for b in blocks("python") if "@replayed" in b)
    release = PLANTED["release"]
    code = (f"from fz3.testing.patch import patched\nwith patched({release.target!r}, {release.replacement!r}):\n"
            f"    exec(compile({shown!r}, 'verify.md', 'exec'), {{'__name__': '__main__'}})\n")
    got = python(code, tmp_path)
    assert got.returncode == 1 and re.search(release.caught, got.stderr), got.stdout + got.stderr


@pytest.mark.parametrize("command", commands())
def test_each_command_runs(command):
    words = shlex.split(command)
    env = dict(os.environ)
    while "=" in words[0]:  # VAR=value before the command
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    assert words[0] == "python"
    got = subprocess.run([sys.executable, *words[1:]], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=240)
    planted = "fz3.testing.planted:" in command
    assert got.returncode == (1 if planted else 0), got.stdout[-3000:] + got.stderr[-3000:]
    if planted:
        assert got.stdout.splitlines()[2].startswith("FAILED in "), got.stdout
