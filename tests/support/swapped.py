"""A DeepSpeed script with its one import line changed, as a user would, run under torchrun on
2 gloo ranks (tests/test_deepspeed_script.py, tests/test_deepspeed_stages.py)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from fz3.launch import free_port


def swapped(script: str, tmp_path) -> str:
    """A copy of `script` in tmp_path with `import deepspeed` made `import fz3.deepspeed as deepspeed`."""
    with open(script) as f:
        text = f.read()
    assert text.count("\nimport deepspeed\n") == 1
    path = tmp_path / ("fz3_" + os.path.basename(script))
    path.write_text(text.replace("\nimport deepspeed\n", "\nimport fz3.deepspeed as deepspeed\n"))
    return str(path)


def run_on_two_ranks(script: str, args: list[str], cwd, timeout: int) -> None:
    """torchrun --nproc_per_node 2 script args, in its own process group (a hang kills every
    rank); fails the test with the output's tail if it hangs past `timeout` or exits non-zero."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FZ3_DEVICE": "cpu"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           script] + args
    proc = subprocess.Popen(cmd, env=env, cwd=str(cwd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"the script did not finish within {timeout} s:\n" + stdout[-3000:] + stderr[-3000:])
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
