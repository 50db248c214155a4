"""A DeepSpeed script runs under fz3 with its import line changed, and trains as DeepSpeed does.

examples/deepspeed_script.py is DeepSpeed's getting-started shape (argparse with
--deepspeed_config, the JSON optimizer and scheduler, save_checkpoint with client_state, resume).
Real DeepSpeed 0.19.8 ran it on 2 gloo ranks (bench/deepspeed_records/deepspeed_script.sh ->
tests/data/deepspeed_script_0.19.8.json); here the same file, with `import deepspeed` replaced
by `import fz3.deepspeed as deepspeed` and nothing else, runs under torchrun on 2 gloo ranks,
and every micro-step's loss (rtol 1e-5), learning rate, counters and boundary answers equal
DeepSpeed's, and so do the parameters after training, after the reload and at the end.
"""
from __future__ import annotations

import json
import os

import pytest

from tests.support.swapped import run_on_two_ranks, swapped

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "deepspeed_script.py")
CONFIG = os.path.join(ROOT, "examples", "deepspeed_config.json")
RECORDED = os.path.join(ROOT, "tests", "data", "deepspeed_script_0.19.8.json")
EXACT = ("global_steps", "global_samples", "micro_steps", "boundary_before_forward", "boundary_after_backward",
         "boundary_after_step", "was_step_applied", "phase", "micro_step")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("deepspeed_script")
    out = tmp / "rows.json"
    args = ["--deepspeed_config", CONFIG, "--out", str(out), "--save_dir", str(tmp / "ckpt")]
    run_on_two_ranks(swapped(SCRIPT, tmp), args, cwd=tmp, timeout=240)
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
