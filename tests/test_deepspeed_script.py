"""A DeepSpeed script runs under fz3 with its import line changed, and trains as DeepSpeed does.

examples/deepspeed_script.py is DeepSpeed's getting-started shape (argparse with
--deepspeed_config, the JSON optimizer and scheduler, save_checkpoint with client_state, resume).
Real DeepSpeed 0.19.8 ran it on 2 gloo ranks (bench/deepspeed_script.sh ->
tests/data/deepspeed_script_0.19.8.json); here the same file, with `import deepspeed` replaced
by `import fz3.deepspeed as deepspeed` and nothing else, runs under torchrun on 2 gloo ranks,
and every micro-step's loss (rtol 1e-5), learning rate, counters and boundary answers equal
DeepSpeed's, and so do the parameters after training, after the reload and at the end.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from fz3.launch import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "deepspeed_script.py")
CONFIG = os.path.join(ROOT, "examples", "deepspeed_config.json")
RECORDED = os.path.join(ROOT, "tests", "data", "deepspeed_script_0.19.8.json")
EXACT = ("global_steps", "global_samples", "micro_steps", "boundary_before_forward", "boundary_after_backward",
         "boundary_after_step", "was_step_applied", "phase", "micro_step")


def swapped(tmp_path) -> str:
    """The script with its one import line changed, as a user would."""
    with open(SCRIPT) as f:
        text = f.read()
    assert text.count("\nimport deepspeed\n") == 1
    path = tmp_path / "fz3_script.py"
    path.write_text(text.replace("\nimport deepspeed\n", "\nimport fz3.deepspeed as deepspeed\n"))
    return str(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("deepspeed_script")
    out = tmp / "rows.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FZ3_DEVICE": "cpu"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           swapped(tmp), "--deepspeed_config", CONFIG, "--out", str(out), "--save_dir", str(tmp / "ckpt")]
    proc = subprocess.Popen(cmd, env=env, cwd=str(tmp), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own process group: a hang kills every rank
    try:
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail("the script did not finish within 240 s:\n" + stdout[-3000:] + stderr[-3000:])
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    with open(out) as f, open(RECORDED) as g:
        return json.load(f), json.load(g)


def test_every_micro_step_is_deepspeeds(runs):
    ours, theirs = runs
    assert len(ours["rows"]) == len(theirs["rows"]) == 10
    for o, t in zip(ours["rows"], theirs["rows"]):
        assert {k: o[k] for k in EXACT} == {k: t[k] for k in EXACT}, t["micro_step"]
        assert o["loss"] == pytest.approx(t["loss"], rel=1e-5) and o["loss_mean"] == pytest.approx(t["loss_mean"], rel=1e-5)
        assert o["lr"] == pytest.approx(t["lr"], rel=1e-9)
        assert (o["grad_norm"] is None) == (t["grad_norm"] is None)
        if t["grad_norm"] is not None:
            assert o["grad_norm"] == pytest.approx(t["grad_norm"], rel=1e-5)


def test_sizes_counters_checkpoint_and_params_are_deepspeeds(runs):
    ours, theirs = runs
    for key in ("world_size", "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                "before_training", "save_checkpoint_returned", "lr_scheduler"):
        assert ours[key] == theirs[key], key
    assert ours["load_checkpoint"]["client_state"] == theirs["load_checkpoint"]["client_state"]
    assert ours["load_checkpoint"]["after"] == theirs["load_checkpoint"]["after"]
    for key in ("params_after_train", "params_after_load", "params_final"):
        assert ours[key].keys() == theirs[key].keys()
        for name, (total, norm) in theirs[key].items():
            assert ours[key][name] == pytest.approx([total, norm], rel=1e-5, abs=1e-6), (key, name)
