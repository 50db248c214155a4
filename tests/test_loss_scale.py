"""fp16's loss scale (fz3/core/grad/scaler.py) against what real DeepSpeed 0.19.8 did.

DeepSpeed ran examples/deepspeed_stages.py on 2 gloo ranks (bench/deepspeed_records/deepspeed_stages.sh ->
tests/data/deepspeed_stages_0.19.8.json): dynamic scales whose first steps overflow and grow back,
hysteresis 1 and 2 with and without consecutive_hysteresis, static scales, a NaN at a static
scale, and the minimum scale reached.

    the transition   each recorded run's boundaries (overflow or not, as DeepSpeed decided)
                     fed to `update_scale` give DeepSpeed's scale after every one
    the config       DeepSpeed's fp16 section and its errors, in the user's words

The same script run by fz3, its import line swapped, is tests/test_deepspeed_stages.py's.
"""
from __future__ import annotations

import json
import os

import pytest

from fz3 import Config
from fz3.core.grad.scaler import LossScale, LossScaleError, initial_scale, update_scale

pytestmark = pytest.mark.timeout(600)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD = json.load(open(os.path.join(ROOT, "tests", "data", "deepspeed_stages_0.19.8.json")))
CASES = RECORD["cases"]
DYNAMIC = sorted(n for n, c in CASES.items() if c["config"].get("fp16", {}).get("loss_scale") == 0
                 and c["config"]["fp16"].get("hysteresis", 2) > 0 and "error" not in c
                 and c["config"]["zero_optimization"]["stage"] > 0)


def _config(ds: dict) -> Config:
    ds = {k: v for k, v in ds.items() if k not in ("optimizer", "scheduler")}
    ds["zero_optimization"] = {"stage": 3}
    with pytest.warns(UserWarning, match="accepts but does not use"):
        return Config.from_deepspeed(ds)


def _boundaries(rows: list) -> list[tuple[bool, float]]:
    """(overflowed, scale after) at each boundary: a row where global_steps moved."""
    out, steps = [], 0
    for r in rows:
        if r["global_steps"] != steps:
            steps = r["global_steps"]
            out.append((not r["was_step_applied"], float(r["scale_after"]["optimizer.loss_scale"])))
    return out


@pytest.mark.parametrize("name", DYNAMIC)
def test_the_transition_moves_the_scale_as_deepspeed_did(name):
    """The recorded overflows in, DeepSpeed's scales out; stages 1-3 alike (stage 0 fp16 is
    DeepSpeed's FP16_UnfusedOptimizer, which never scales its loss: see the recording's notes)."""
    case = CASES[name]
    config = _config(case["config"])
    state = initial_scale(config)
    start = case["scaler_at_start"]
    assert (state.scale, state.hysteresis) == (start["cur_scale"], start["cur_hysteresis"])
    seen = _boundaries(case["rows"])
    assert any(o for o, _ in seen) and any(not o for o, _ in seen), name
    for i, (overflow, scale) in enumerate(seen):
        state = update_scale(state, overflow, config=config)
        assert state.scale == scale, (name, i, state, scale)


def test_the_minimum_scale_reached_is_an_error_in_the_users_words():
    """DeepSpeed raises a bare Exception ('Current loss scale already at minimum'); fz3's names
    the key to change and quotes it."""
    config = Config(compute_dtype="fp16", initial_scale_power=1, hysteresis=1, min_loss_scale=1)
    state = update_scale(initial_scale(config), True, config=config)
    assert state.scale == 1.0
    with pytest.raises(LossScaleError, match=r"(?s)minimum loss scale 1 \(fp16.min_loss_scale\).*Lower "
                                             r"fp16.min_loss_scale.*Current loss scale already at minimum"):
        update_scale(state, True, config=config)
    assert "Current loss scale already at minimum" in RECORD["errors"]["min_loss_scale_reached"]["error"]["message"]


def test_a_static_scale_and_fp32_never_move():
    for config in (Config(compute_dtype="fp16", loss_scale=128), Config()):
        state = initial_scale(config)
        for overflow in (True, False, True):
            assert update_scale(state, overflow, config=config) == state
    assert initial_scale(Config()).scale == 1.0 and initial_scale(Config(compute_dtype="fp16", loss_scale=128)).scale == 128


def test_growth_refills_the_hysteresis_and_counts_round_the_window():
    config = Config(compute_dtype="fp16", initial_scale_power=4, loss_scale_window=2, hysteresis=2)
    s = initial_scale(config)
    s = update_scale(s, True, config=config)  # hysteresis spent, the scale stays
    assert s == LossScale(16.0, 0, 1)
    for want in (LossScale(16.0, 1, 1), LossScale(16.0, 2, 1), LossScale(32.0, 1, 2), LossScale(32.0, 2, 2),
                 LossScale(64.0, 1, 2)):
        s = update_scale(s, False, config=config)
        assert s == want


# ---- the config ----------------------------------------------------------------------------------

def _ds(**fp16):
    return {"zero_optimization": {"stage": 3}, "fp16": {"enabled": True, **fp16}}


def test_deepspeeds_fp16_section_is_read():
    cfg = Config.from_deepspeed(_ds(loss_scale=0, initial_scale_power=12, loss_scale_window=50, hysteresis=3,
                                    consecutive_hysteresis=True, min_loss_scale=0.5))
    assert (cfg.compute_dtype, cfg.loss_scale, cfg.initial_scale_power, cfg.loss_scale_window, cfg.hysteresis,
            cfg.consecutive_hysteresis, cfg.min_loss_scale) == ("fp16", 0, 12, 50, 3, True, 0.5)
    assert Config.from_deepspeed(_ds(loss_scale=128.0)).loss_scale == 128.0


def test_auto_in_fp16_is_deepspeeds_default():
    """DeepSpeed drops an "auto" in its fp16 section (the recording's "auto" part): the default
    stands, and enabled "auto" is off."""
    cfg = Config.from_deepspeed(_ds(**{k: "auto" for k in ("loss_scale", "initial_scale_power", "loss_scale_window",
                                                            "hysteresis", "consecutive_hysteresis",
                                                            "min_loss_scale")}))
    assert cfg == Config(compute_dtype="fp16", gradient_clipping=1.0)
    with pytest.warns(UserWarning, match="fp16"):
        assert Config.from_deepspeed({"zero_optimization": {"stage": 3}, "fp16": {"enabled": "auto"}}).compute_dtype \
            == "fp32"
    assert "fp16.enabled" in RECORD["auto"]


@pytest.mark.parametrize("ds, match", [
    ({"zero_optimization": {"stage": 3}, "fp16": {"enabled": True}, "bf16": {"enabled": True}},
     r"'fp16.enabled' and 'bf16.enabled' are both true.*cannot be simultaneously enabled"),
    (_ds(loss_scale=-1), r"fp16.loss_scale\) must be a finite number >= 0 \(0: dynamic loss scaling\), got -1"),
    (_ds(loss_scale_window=0), r"loss_scale_window must be >= 1, got 0"),
    (_ds(min_loss_scale=0), r"min_loss_scale\) must be a finite number > 0, got 0"),
    (_ds(hysteresis=0), r"hysteresis\) = 0: DeepSpeed 0.19.8 accepts it.*never halves.*use 1"),
    (_ds(loss_scael=0), r"unknown fp16 key 'loss_scael' \(misspelt\?\)"),
    (_ds(fp16_master_weights_and_grads=True), r"fp16.fp16_master_weights_and_grads' = True: fz3 keeps fp32"),
])
def test_bad_fp16_input_names_the_key_the_value_and_what_is_allowed(ds, match):
    with pytest.raises(ValueError, match=match):
        Config.from_deepspeed(ds)


def test_deepspeed_refuses_the_same_inputs():
    """The recording: each config refused above is refused by DeepSpeed 0.19.8 (hysteresis 0
    aside, which it takes and then never lowers the scale)."""
    for name in ("fp16_and_bf16", "fp16_loss_scale_negative", "fp16_loss_scale_window_zero", "fp16_min_loss_scale_zero"):
        assert RECORD["errors"][name]["error"]["at"] == "initialize", name
    rows = CASES["fp16_dynamic_hysteresis0_stage2"]["rows"]
    assert not any(r["was_step_applied"] for r in rows)  # every step skipped, the scale never lowered
