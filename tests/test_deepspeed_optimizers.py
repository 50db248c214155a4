"""fz3.deepspeed.optimizers against real DeepSpeed 0.19.8 at ZeRO stage 3 on CPU: for each
recorded JSON "optimizer" section, the torch class fz3 builds for what DeepSpeed built, its
defaults, and the params after each of 5 steps on the recorded grads (two param groups, the
second with its own lr and weight_decay); then the refusals, each naming the key and value.

The table is tests/data/deepspeed_schedules_0.19.8.json, written by bench/deepspeed_records/deepspeed_schedules.py
under bench/.env (a real deepspeed.initialize per row; fz3 never imports DeepSpeed).

[Note: float32 scalars] DeepSpeed's CPU FusedAdam op takes lr, betas and eps as C++ floats and
forms the bias corrections in float32; torch.optim.AdamW keeps them in double. Over 5 steps at
lr 0.05 that moves a param by up to 7e-7 (the recorded values agree with a float32-scalar
re-computation to 4e-9), so params are compared at rtol 1e-6 with atol 1e-6, which still
tells decoupled from L2 weight decay (5e-4 at the first step) and a weight_decay of 0.01
from 0 (5e-5).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fz3.deepspeed.optimizers import FusedAdamMath, build_optimizer
from fz3.deepspeed.schedulers import build_scheduler

DATA = json.loads((Path(__file__).parent / "data" / "deepspeed_schedules_0.19.8.json").read_text())
SETUP = DATA["optimizer_setup"]
ROWS = {row["name"]: row for row in DATA["optimizers"]}


def model_parameters(group_extra: dict | None = None):
    """The recording's two params, as DeepSpeed's model_parameters: two param-group dicts."""
    params = [torch.nn.Parameter(torch.tensor(values)) for values in SETUP["initial"]]
    groups = [{"params": [p], **options, **(group_extra or {})} for p, options in zip(params, SETUP["group_options"])]
    return params, groups


def fz3_class_for(row: dict) -> type:
    """The torch class fz3 builds for the class DeepSpeed built ([Note: FusedAdam's numbers] in
    fz3/deepspeed/optimizers.py)."""
    if row["built"].endswith("FusedAdam"):
        if not row["defaults"]["bias_correction"]:
            return FusedAdamMath
        return torch.optim.AdamW if row["adam_w_mode"] else torch.optim.Adam
    module, name = row["built"].rsplit(".", 1)
    assert module.startswith("torch.optim")
    return getattr(torch.optim, name)


def train(row: dict, opt: torch.optim.Optimizer, params: list[torch.Tensor], scheduler=None) -> None:
    """5 steps on the recorded grads, as the engine runs them: step, zero_grad, scheduler step."""
    for k, grads in enumerate(SETUP["grads"]):
        for p, grad in zip(params, grads):
            p.grad = torch.tensor(grad)
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
            assert [g["lr"] for g in opt.param_groups] == pytest.approx(row["lr"][k + 1], rel=1e-12)
        for p, values in zip(params, row["values"][k]):
            torch.testing.assert_close(p.detach(), torch.tensor(values), rtol=1e-6, atol=1e-6,
                                       msg=lambda m: f"{row['name']} step {k + 1}: {m}")


@pytest.mark.parametrize("row", DATA["optimizers"], ids=lambda row: row["name"])
def test_optimizer_matches_deepspeed_zero3(row):
    params, groups = model_parameters()
    opt = build_optimizer(row["section"], groups)
    assert type(opt) is fz3_class_for(row)
    for key in ("lr", "betas", "eps", "weight_decay", "amsgrad", "momentum", "dampening", "nesterov"):
        if key in row["defaults"]:
            ours = opt.defaults[key]
            assert (list(ours) if key == "betas" else ours) == row["defaults"][key], key
    assert [g["weight_decay"] for g in opt.param_groups][1] == 0.0  # the group's own setting wins
    scheduler = build_scheduler(row["scheduler"], opt) if "scheduler" in row else None
    if scheduler is not None:
        assert [g["lr"] for g in opt.param_groups] == row["lr"][0]
    train(row, opt, params, scheduler)


def test_deepspeeds_picks():
    """What DeepSpeed 0.19.8 built at ZeRO-3 on CPU, as recorded: FusedAdam (its JIT CPU op)
    for Adam/AdamW, with AdamW's decoupled decay unless "Adam" says adam_w_mode false; torch's
    own class with torch_adam (whose AdamW default weight_decay is 0.01, FusedAdam's 0.0)."""
    picks = {name: (row["built"].rsplit(".", 1)[1], row["adam_w_mode"]) for name, row in ROWS.items()}
    assert picks["adam_default_wd"] == ("FusedAdam", 1) and picks["adam_l2"] == ("FusedAdam", 0)
    assert picks["adamw_l2_flag_ignored"] == ("FusedAdam", 1)
    assert picks["adam_torch"] == ("AdamW", None) and picks["adam_torch_l2_amsgrad"] == ("Adam", None)
    assert ROWS["adam_torch"]["defaults"]["weight_decay"] == 0.01
    assert build_optimizer({"type": "Adam"}, [torch.nn.Parameter(torch.zeros(1))]).defaults["weight_decay"] == 0.0
    assert not ROWS["sgd_plain"]["zero_tested"]  # DeepSpeed wants zero_allow_untested_optimizer for SGD


def test_bias_correction_false_in_a_param_group():
    """FusedAdam reads bias_correction per group: set in both groups it equals the section's."""
    row = ROWS["adam_lower_no_bias_correction"]
    section = {"type": "Adam", "params": {k: v for k, v in row["section"]["params"].items() if k != "bias_correction"}}
    params, groups = model_parameters({"bias_correction": False})
    opt = build_optimizer(section, groups)
    assert type(opt) is FusedAdamMath
    train(row, opt, params)


@pytest.mark.parametrize("name", ["adam_default_wd", "adam_l2", "adam_lower_no_bias_correction"])
def test_fused_adam_math_with_bias_correction_either_way(name):
    """FusedAdamMath is FusedAdam's update with or without bias correction, in either mode
    (build_optimizer picks it only when some group turns bias correction off)."""
    row = ROWS[name]
    options = {k: v for k, v in row["section"]["params"].items() if k != "adam_w_mode"}
    params, groups = model_parameters()
    opt = FusedAdamMath(groups, adam_w_mode=bool(row["adam_w_mode"]), **options)
    train(row, opt, params)


def test_generator_of_params_and_type_case():
    model = torch.nn.Linear(2, 2)
    for name in ("adam", "ADAMW", "AdamW"):
        opt = build_optimizer({"type": name, "params": {"lr": 0.1}}, model.parameters())
        assert type(opt) is torch.optim.AdamW and len(opt.param_groups[0]["params"]) == 2


@pytest.mark.parametrize("row", [r for r in DATA["refusals"] if r["kind"] == "optimizer"],
                         ids=lambda r: json.dumps(r["section"]))
def test_deepspeed_refusals_are_errors(row):
    assert row["deepspeed"] is not None
    with pytest.raises(ValueError):
        build_optimizer(row["section"], [torch.nn.Parameter(torch.zeros(2))])


BAD = [
    ({"type": "Adam", "params": {"betas2": [0.9, 0.99]}}, "'betas2' = [0.9, 0.99]", "bias_correction"),
    ({"type": "SGD", "params": {"betas": [0.9, 0.99]}}, "'betas' = [0.9, 0.99]", "momentum"),
    ({"type": "SGD", "params": {"adam_w_mode": True}}, "'adam_w_mode' = True", "nesterov"),
    ({"type": "Adam", "params": {"torch_adam": True, "bias_correction": False}}, "'bias_correction' = False",
     "amsgrad"),
    ({"type": "Adam", "params": {"amsgrad": True}}, "'amsgrad' = True", "torch_adam"),
    ({"type": "Adam", "params": {"lr": "auto"}}, "'lr' = 'auto'", "Trainer"),
    ({"type": "Adam", "params": {"max_grad_norm": 1.0}}, "'max_grad_norm' = 1.0", "gradient_clipping"),
    ({"type": "Adam", "params": {"adam_w_mode": "yes"}}, "'adam_w_mode' = 'yes'", "true or false"),
    ({"type": "Lamb", "params": {}}, "'Lamb'", "Adam, AdamW, SGD"),
    ({"type": "OneBitAdam", "params": {}}, "'OneBitAdam'", "Adam, AdamW, SGD"),
    ({"type": "Muon", "params": {}}, "'Muon'", "its own muon"),
    ({"type": "sgd", "params": {}}, "'sgd'", "write 'SGD'"),
    ({"type": "RMSprop", "params": {"momentun": 0.9}}, "unknown parameter 'momentun' = 0.9", "momentum"),
    ({"type": "Adam", "param": {"lr": 0.1}}, "unknown key 'param' = {'lr': 0.1}", "type, params"),
    ({"params": {"lr": 0.1}}, "'type' = None", ""),
    ({"type": "Adam", "params": [0.1]}, "'params' = [0.1]", "dict"),
]


@pytest.mark.parametrize("section, names, allowed", BAD, ids=lambda x: str(x)[:40])
def test_bad_sections_name_the_key_and_value(section, names, allowed):
    with pytest.raises(ValueError) as info:
        build_optimizer(section, [torch.nn.Parameter(torch.zeros(2))])
    message = str(info.value)
    assert names in message and allowed in message, message


@pytest.mark.parametrize("section, cls", [
    ({"type": "RMSprop", "params": {"lr": 0.01, "momentum": 0.5}}, torch.optim.RMSprop),
    ({"type": "adagrad", "params": {"lr": 0.01}}, torch.optim.Adagrad),
])
def test_other_torch_optimizers_are_built_as_deepspeed_looks_them_up(section, cls):
    """DeepSpeed: a type it does not own is getattr(torch.optim, type)(params, **params);
    "adagrad" (its own name, any case) is torch's Adagrad without offload."""
    opt = build_optimizer(section, [torch.nn.Parameter(torch.zeros(2))])
    assert type(opt) is cls and all(opt.defaults[k] == v for k, v in section["params"].items())


def test_on_an_accelerator_the_fused_adam_is_torchs_fused_one():
    """fz3.deepspeed.initialize builds FusedAdam's stand-in fused where the device is an
    accelerator (build_optimizer(fused=True)): it takes the skip of a non-finite step as a tensor
    ([Note: the verdict on the device]); torch_adam and the other optimizers are left as asked."""
    p = [torch.nn.Parameter(torch.zeros(2))]
    assert build_optimizer({"type": "AdamW"}, p, fused=True).defaults["fused"] is True
    assert build_optimizer({"type": "Adam", "params": {"adam_w_mode": False}}, p, fused=True).defaults["fused"] is True
    assert not build_optimizer({"type": "AdamW"}, p).defaults["fused"]
    assert not build_optimizer({"type": "AdamW", "params": {"torch_adam": True}}, p, fused=True).defaults["fused"]
    assert not build_optimizer({"type": "SGD", "params": {"lr": 0.1}}, p, fused=True).defaults.get("fused")
