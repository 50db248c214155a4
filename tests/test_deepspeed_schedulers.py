"""fz3.deepspeed.schedulers against real DeepSpeed 0.19.8: every recorded schedule's lr (and
OneCycle's betas / SGD's momentum) after construction and after every step, a state_dict round
trip mid-schedule, and the refusals, each naming the key and value.

The table is tests/data/deepspeed_schedules_0.19.8.json, written by bench/deepspeed_records/deepspeed_schedules.py
(run under bench/.env, where DeepSpeed is installed; fz3 never imports it).
"""
from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
import torch
from torch.optim.lr_scheduler import LRScheduler

from fz3.deepspeed.schedulers import build_scheduler

DATA = json.loads((Path(__file__).parent / "data" / "deepspeed_schedules_0.19.8.json").read_text())
ROWS = {row["name"]: row for row in DATA["schedules"]}


def optimizer(kind: str, lrs: list[float]) -> torch.optim.Optimizer:
    """The recording's optimizer: one 2-element param per group, each group its own lr."""
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    if kind == "SGD":
        return torch.optim.SGD(groups, lr=lrs[0], momentum=0.9)
    return torch.optim.AdamW(groups, lr=lrs[0])


def assert_at(row: dict, opt: torch.optim.Optimizer, k: int) -> None:
    """The param groups hold what DeepSpeed's held after k steps (k = 0: construction)."""
    got = [group["lr"] for group in opt.param_groups]
    assert all(math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0) for a, b in zip(got, row["lr"][k], strict=True)), \
        (row["name"], k, got, row["lr"][k])
    if "betas" in row:
        betas = [list(group["betas"]) for group in opt.param_groups]
        assert all(math.isclose(a, b, rel_tol=1e-12) for g, r in zip(betas, row["betas"][k], strict=True)
                   for a, b in zip(g, r, strict=True)), (row["name"], k, betas, row["betas"][k])
    if "momentum" in row:
        assert [group["momentum"] for group in opt.param_groups] == row["momentum"][k]


@pytest.mark.parametrize("row", DATA["schedules"], ids=lambda row: row["name"])
def test_schedule_matches_deepspeed(row):
    opt = optimizer(row["optimizer"], row["group_lrs"])
    scheduler = build_scheduler(row["section"], opt)
    assert isinstance(scheduler, LRScheduler) and type(scheduler).__name__ == row["section"]["type"]
    assert_at(row, opt, 0)
    for k in range(1, row["steps"] + 1):
        opt.step()
        scheduler.step()
        assert_at(row, opt, k)
    assert scheduler.last_batch_iteration == row["state_dict"]["last_batch_iteration"]
    assert scheduler.get_last_lr() == [group["lr"] for group in opt.param_groups]


def test_table_covers_every_schedule_and_option():
    types = {row["section"]["type"] for row in DATA["schedules"]}
    assert types == {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"}
    keys = {key for row in DATA["schedules"] for key in row["section"]["params"]}
    assert {"warmup_type", "cos_min_ratio", "warmup_min_ratio", "cycle_momentum", "decay_lr_rate", "decay_mom_rate",
            "cycle_first_stair_count", "lr_range_test_staircase"} <= keys
    assert sum(len(row["group_lrs"]) > 1 for row in DATA["schedules"]) >= 2


@pytest.mark.parametrize("name, middle", [("cosine_linear_ratios", 17), ("onecycle_decay_groups", 23),
                                          ("decay_log_groups", 7), ("warmup_defaults", 11)])
def test_state_dict_round_trip_mid_schedule(name, middle):
    """A checkpoint at step `middle` (optimizer and scheduler through torch.save), loaded into a
    freshly built pair, goes on exactly as DeepSpeed's uninterrupted schedule."""
    row = ROWS[name]
    opt = optimizer(row["optimizer"], row["group_lrs"])
    scheduler = build_scheduler(row["section"], opt)
    for _ in range(middle):
        opt.step()
        scheduler.step()
    buffer = io.BytesIO()
    torch.save({"optimizer": opt.state_dict(), "scheduler": scheduler.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    opt2 = optimizer(row["optimizer"], row["group_lrs"])
    scheduler2 = build_scheduler(row["section"], opt2)
    opt2.load_state_dict(saved["optimizer"])
    scheduler2.load_state_dict(saved["scheduler"])
    assert scheduler2.last_batch_iteration == middle - 1
    assert_at(row, opt2, middle)
    for k in range(middle + 1, row["steps"] + 1):
        opt2.step()
        scheduler2.step()
        assert_at(row, opt2, k)


def test_deepspeeds_own_state_dict_and_step_argument():
    """DeepSpeed saves {"last_batch_iteration": i} and its step() takes the iteration."""
    row = ROWS["cosine_defaults"]
    opt = optimizer(row["optimizer"], row["group_lrs"])
    scheduler = build_scheduler(row["section"], opt)
    scheduler.load_state_dict({"last_batch_iteration": 9})
    opt.step()
    scheduler.step()
    assert_at(row, opt, 11)
    scheduler.step(20)  # DeepSpeed's step(last_batch_iteration): lr at iteration 20, as after 21 steps
    assert scheduler.last_batch_iteration == 20
    assert_at(row, opt, 21)


def test_onecycle_momentum_left_alone_without_betas_unless_asked():
    row = ROWS["onecycle_sgd"]
    assert all(m == [0.9] for m in row["momentum"])  # DeepSpeed: no betas, nothing cycled
    section = {"type": "OneCycle", "params": {**row["section"]["params"], "cycle_momentum": True}}
    with pytest.raises(ValueError, match=r"'cycle_momentum' = True.*SGD has no betas"):
        build_scheduler(section, optimizer("SGD", [0.1]))


# DeepSpeed refuses 10.0 in a dict config, but its JSON file reader (hjson) makes it the int 10
INTEGRAL_FLOAT = {"type": "WarmupLR", "params": {"warmup_num_steps": 10.0}}


@pytest.mark.parametrize("row", [r for r in DATA["refusals"] if r["kind"] == "scheduler"
                                 and r["section"] != INTEGRAL_FLOAT], ids=lambda r: json.dumps(r["section"]))
def test_deepspeed_refusals_are_errors(row):
    """What DeepSpeed refuses (its exception recorded), and what it accepts only by doing
    something else (a warmup_type it does not know warms up as 'log'), fz3 refuses."""
    with pytest.raises(ValueError):
        build_scheduler(row["section"], optimizer("AdamW", [0.1]))


def test_integral_float_step_counts_are_ints():
    row = ROWS["warmup_linear"]
    opt = optimizer(row["optimizer"], row["group_lrs"])
    scheduler = build_scheduler({"type": "WarmupLR", "params": {**row["section"]["params"], "warmup_num_steps": 10.0}},
                                opt)
    assert scheduler.warmup_num_steps == 10 and type(scheduler.warmup_num_steps) is int
    for k in range(1, row["steps"] + 1):
        opt.step()
        scheduler.step()
        assert_at(row, opt, k)


BAD = [
    ({"type": "WarmupLR", "params": {"warmup_steps": 10}}, "'warmup_steps' = 10", "warmup_num_steps"),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_max_lr": 0.1}},
     "'warmup_max_lr' = 0.1", "cos_min_ratio"),
    ({"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}, "'total_num_steps' is required", ""),
    ({"type": "OneCycle", "params": {"cycle_max_lr": 0.1}}, "'cycle_min_lr' is required", ""),
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 0}}, "'warmup_num_steps' = 0", "positive integer"),
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 10.5}}, "'warmup_num_steps' = 10.5", "positive integer"),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 9, "warmup_num_steps": True}},
     "'warmup_num_steps' = True", ""),
    ({"type": "WarmupLR", "params": {"warmup_min_lr": [0.0, 0.1, 0.2]}}, "'warmup_min_lr' = [0.0, 0.1, 0.2]",
     "expected 1 values"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 0}},
     "cycle_first_step_size = 0", "positive"),
    ({"type": "LRRangeTest", "params": {"lr_range_test_step_size": 0}}, "'lr_range_test_step_size' = 0", ""),
    ({"type": "WarmupLR", "params": {"warmup_type": "cosine"}}, "'warmup_type' = 'cosine'", "log, linear"),
    ({"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}, "'total_num_steps' = 'auto'", "Trainer"),
    ({"type": "WarmupDecayLR", "params": {"total_num_steps": None}}, "'total_num_steps' = None", "number"),
    ({"type": "WarmupLR", "params": {"last_batch_iteration": 5}}, "last_batch_iteration = 5", "load_state_dict"),
    ({"type": "WarmupLR"}, "has no 'params'", '"params": {}'),
    ({"type": "WarmupLR", "param": {}}, "unknown key 'param' = {}", "type, params"),
    ({"params": {}}, "'type' = None", ""),
    ({"type": "StepLR", "params": {"step_sise": 3}}, "unknown parameter 'step_sise' = 3", "step_size"),
    ({"type": "warmuplr", "params": {}}, "'warmuplr'", "write 'WarmupLR'"),
    ({"type": "Cosine", "params": {}}, "'Cosine'", "WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest"),
]


@pytest.mark.parametrize("section, names, allowed", BAD, ids=lambda x: str(x)[:40])
def test_bad_sections_name_the_key_and_value(section, names, allowed):
    with pytest.raises(ValueError) as info:
        build_scheduler(section, optimizer("AdamW", [0.1]))
    message = str(info.value)
    assert names in message and allowed in message, message


def test_last_batch_iteration_minus_one_is_a_fresh_schedule():
    row = ROWS["warmup_linear"]
    opt = optimizer(row["optimizer"], row["group_lrs"])
    section = {"type": "WarmupLR", "params": {**row["section"]["params"], "last_batch_iteration": -1}}
    build_scheduler(section, opt)
    assert_at(row, opt, 0)


def test_a_torch_scheduler_type_is_built_as_deepspeed_falls_back_to_it():
    """DeepSpeed: a type it does not own is torch.optim.lr_scheduler.<type>(optimizer, **params)."""
    opt = optimizer("AdamW", [0.1])
    sched = build_scheduler({"type": "StepLR", "params": {"step_size": 1, "gamma": 0.5}}, opt)
    opt.step()
    sched.step()
    assert type(sched) is torch.optim.lr_scheduler.StepLR and opt.param_groups[0]["lr"] == 0.05
