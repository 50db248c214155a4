"""Real DeepSpeed 0.19.8's JSON "scheduler" and "optimizer" sections, recorded for fz3's tests.

    python3 bench/deepspeed_records/deepspeed_schedules.py   # re-runs itself under bench/.env
                                                     # (DS_ACCELERATOR=cpu); writes
                                                     # tests/data/deepspeed_schedules_0.19.8.json

Three tables (and optimizer_setup, the params and grads the optimizer rows share), each row the
JSON section it was built from:
  schedules   DeepSpeed's scheduler class (deepspeed.runtime.lr_schedules, picked by name as
              DeepSpeedEngine._scheduler_from_config picks it) on a torch optimizer with the
              row's param-group lrs; lr[k] (and betas[k] / momentum[k] where the row cycles
              momentum) after construction (k = 0) and after k step() calls.
  optimizers  what deepspeed.initialize at ZeRO stage 3, CPU, no offload builds from the
              section (the engine's basic_optimizer class) and the param values after each of 5
              engine.step()s on fixed grads: a real engine, one rank, gloo, gradient_clipping 0.
              Rows with a "scheduler" also record the engine's lr at every step.
  refusals    sections DeepSpeed refuses (the exception it raises) or accepts by changing what
              was asked (deepspeed: null, with what it does instead in "note").

The first run JIT-compiles DeepSpeed's CPU FusedAdam op (2 to 4 minutes on 2 busy cores, cached in
~/.cache/torch_extensions); later runs take a few seconds.
"""
from __future__ import annotations

import datetime
import importlib
import json
import logging
import os
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)  # bench/: the harness (bench_env)
OUT = os.path.join(os.path.dirname(BENCH), "tests", "data", "deepspeed_schedules_0.19.8.json")

if __name__ == "__main__":
    sys.path[:0] = [HERE, BENCH]
    from bench_env import ensure_env
    ensure_env(__file__)

os.environ.setdefault("DS_ACCELERATOR", "cpu")
warnings.simplefilter("ignore")

import torch  # noqa: E402

# Each schedule row: the JSON section, the optimizer it wraps ("AdamW" has betas, "SGD" has
# not) with one lr per param group, and how many steps to record.
SCHEDULES = [
    ("warmup_defaults", "AdamW", [0.1, 0.01], 30, {"type": "WarmupLR", "params": {}}),
    ("warmup_linear", "AdamW", [0.1], 14, {"type": "WarmupLR", "params": {
        "warmup_min_lr": 0.001, "warmup_max_lr": 0.05, "warmup_num_steps": 10, "warmup_type": "linear"}}),
    ("warmup_log_groups", "AdamW", [0.1, 0.01], 12, {"type": "WarmupLR", "params": {
        "warmup_min_lr": [0.0, 0.001], "warmup_max_lr": [0.1, 0.02], "warmup_num_steps": 8, "warmup_type": "log"}}),
    ("warmup_one_step", "SGD", [0.1], 5, {"type": "WarmupLR", "params": {
        "warmup_max_lr": 0.2, "warmup_num_steps": 1, "warmup_type": "linear"}}),
    ("decay_linear_default_max", "AdamW", [0.1], 40, {"type": "WarmupDecayLR", "params": {
        "total_num_steps": 30, "warmup_num_steps": 10, "warmup_type": "linear"}}),
    ("decay_log_groups", "AdamW", [0.1, 0.01], 30, {"type": "WarmupDecayLR", "params": {
        "total_num_steps": 25, "warmup_min_lr": 0.01, "warmup_max_lr": [0.1, 0.05], "warmup_num_steps": 5}}),
    ("decay_max_null", "SGD", [0.3, 0.03], 24, {"type": "WarmupDecayLR", "params": {
        "total_num_steps": 20, "warmup_max_lr": None, "warmup_num_steps": 4, "warmup_type": "linear"}}),
    ("cosine_defaults", "AdamW", [0.1, 0.02], 36, {"type": "WarmupCosineLR", "params": {
        "total_num_steps": 30, "warmup_num_steps": 8}}),
    ("cosine_linear_ratios", "AdamW", [0.1, 0.02], 50, {"type": "WarmupCosineLR", "params": {
        "total_num_steps": 40, "warmup_num_steps": 10, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.05,
        "warmup_type": "linear"}}),
    ("cosine_total_below_warmup", "SGD", [0.1], 14, {"type": "WarmupCosineLR", "params": {
        "total_num_steps": 5, "warmup_num_steps": 10, "warmup_type": "linear"}}),
    ("onecycle_defaults", "AdamW", [0.1], 40, {"type": "OneCycle", "params": {
        "cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 10}}),
    ("onecycle_decay_groups", "AdamW", [0.1, 0.01], 40, {"type": "OneCycle", "params": {
        "cycle_min_lr": [0.01, 0.001], "cycle_max_lr": [0.1, 0.02], "cycle_first_step_size": 8,
        "cycle_second_step_size": 12, "decay_step_size": 5, "decay_lr_rate": 0.5, "cycle_min_mom": 0.85,
        "cycle_max_mom": [0.95, 0.9], "decay_mom_rate": 0.01}}),
    ("onecycle_stairs", "AdamW", [0.1], 30, {"type": "OneCycle", "params": {
        "cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 10, "cycle_first_stair_count": 5,
        "cycle_second_step_size": 6, "cycle_second_stair_count": 3, "cycle_momentum": False}}),
    ("onecycle_sgd", "SGD", [0.1], 24, {"type": "OneCycle", "params": {
        "cycle_min_lr": 0.02, "cycle_max_lr": 0.2, "cycle_first_step_size": 6, "decay_step_size": 2,
        "decay_lr_rate": 0.1}}),
    ("range_defaults", "AdamW", [0.1], 20, {"type": "LRRangeTest", "params": {}}),
    ("range_staircase_groups", "AdamW", [0.1, 0.01], 24, {"type": "LRRangeTest", "params": {
        "lr_range_test_min_lr": [0.001, 0.0001], "lr_range_test_step_size": 5, "lr_range_test_step_rate": 2.0,
        "lr_range_test_staircase": True}}),
    ("range_continuous", "SGD", [0.1], 20, {"type": "LRRangeTest", "params": {
        "lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 4, "lr_range_test_step_rate": 0.5,
        "lr_range_test_staircase": False}}),
]

# Each optimizer row: the JSON section; every row trains the same two param groups (GROUPS).
OPTIMIZERS = [
    ("adam_default_wd", {"type": "Adam", "params": {"lr": 0.01, "weight_decay": 0.1}}),
    ("adam_l2", {"type": "Adam", "params": {"lr": 0.01, "weight_decay": 0.1, "adam_w_mode": False}}),
    ("adamw_l2_flag_ignored", {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1, "adam_w_mode": False}}),
    ("adam_lower_no_bias_correction", {"type": "adam", "params": {
        "lr": 0.02, "betas": [0.8, 0.99], "eps": 1e-6, "bias_correction": False, "weight_decay": 0.05}}),
    ("adam_torch", {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}}),
    ("adam_torch_l2_amsgrad", {"type": "ADAM", "params": {
        "lr": 0.01, "torch_adam": True, "adam_w_mode": False, "amsgrad": True, "weight_decay": 0.1}}),
    ("sgd_momentum", {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}}),
    ("sgd_nesterov", {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.8, "nesterov": True, "dampening": 0}}),
    ("sgd_plain", {"type": "SGD", "params": {"lr": 0.1}}),
    ("adam_with_warmup_decay", {"type": "Adam", "params": {"lr": 0.01}},
     {"type": "WarmupDecayLR", "params": {"total_num_steps": 4, "warmup_num_steps": 2, "warmup_max_lr": 0.05,
                                          "warmup_type": "linear"}}),
]
INITIAL = [[0.5, -1.0, 2.0], [[0.25, -0.75], [1.5, -2.0]]]
GROUP_OPTIONS = [{}, {"lr": 0.05, "weight_decay": 0.0}]  # the second group's own settings
OPTIMIZER_STEPS = 5

REFUSED_OPTIMIZERS = [
    {"type": "sgd", "params": {"lr": 0.1}},
    {"type": "Adam", "params": {"lr": 0.01, "amsgrad": True}},
    {"type": "Adam", "params": {"torch_adam": True, "bias_correction": False}},
    {"type": "Adam", "params": {"lr": 0.01, "betas2": [0.9, 0.99]}},
    {"type": "SGD", "params": {"lr": 0.1, "betas": [0.9, 0.99]}},
    {"type": "SGD", "params": {"lr": 0.1, "adam_w_mode": True}},
    {"type": "Adam", "params": {"lr": 0.01, "max_grad_norm": 1.0}},
]
REFUSED_SCHEDULERS = [
    ({"type": "WarmupLR", "params": {"warmup_steps": 10}}, None),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_max_lr": 0.1}}, None),
    ({"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}, None),
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 0}}, None),
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 10.0}}, None),
    ({"type": "WarmupLR", "params": {"warmup_min_lr": [0.0, 0.1, 0.2]}}, None),
    ({"type": "OneCycle", "params": {"cycle_max_lr": 0.1}}, None),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 0}}, None),
    ({"type": "LRRangeTest", "params": {"lr_range_test_step_size": 0}}, None),
    ({"type": "WarmupLR"}, None),
    ({"type": "WarmupLR", "params": {"warmup_type": "cosine", "warmup_num_steps": 4}},
     "DeepSpeed logs a warning and warms up with 'log'"),
    ({"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}},
     "DeepSpeed fails on the string at construction (warmup_max_lr - warmup_min_lr)"),
]


def torch_optimizer(kind: str, lrs: list[float]) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    if kind == "SGD":
        return torch.optim.SGD(groups, lr=lrs[0], momentum=0.9)
    return torch.optim.AdamW(groups, lr=lrs[0])


def ds_scheduler(section: dict, optimizer: torch.optim.Optimizer):
    """As DeepSpeedEngine._scheduler_from_config: the lr_schedules class by name, **params."""
    from deepspeed.runtime import lr_schedules
    return getattr(lr_schedules, section["type"])(optimizer, **section["params"])


def record_schedule(name: str, kind: str, lrs: list[float], steps: int, section: dict) -> dict:
    optimizer = torch_optimizer(kind, lrs)
    scheduler = ds_scheduler(section, optimizer)
    moms = {"AdamW": "betas", "SGD": "momentum"}[kind]
    lr_rows, mom_rows = [], []
    for k in range(steps + 1):
        if k:
            scheduler.step()
        lr_rows.append([float(g["lr"]) for g in optimizer.param_groups])
        mom_rows.append([list(g["betas"]) if moms == "betas" else g["momentum"] for g in optimizer.param_groups])
    row = {"name": name, "optimizer": kind, "group_lrs": lrs, "steps": steps, "section": section, "lr": lr_rows}
    if section["type"] == "OneCycle" or any(m != mom_rows[0] for m in mom_rows):  # only OneCycle moves them
        row[moms] = mom_rows
    row["state_dict"] = scheduler.state_dict()
    return row


def init_one_rank() -> None:
    import deepspeed
    from deepspeed.utils import logger
    logger.setLevel(logging.ERROR)
    # the shared-memory all-reduce op is for inference all-reduce only; skip its JIT build
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29631"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)


class FixedGrads(torch.nn.Module):
    """loss = sum(w0 * g0) + sum(w1 * g1): the grads are exactly g0, g1."""

    def __init__(self) -> None:
        super().__init__()
        self.w0 = torch.nn.Parameter(torch.tensor(INITIAL[0]))
        self.w1 = torch.nn.Parameter(torch.tensor(INITIAL[1]))

    def forward(self, g0: torch.Tensor, g1: torch.Tensor) -> torch.Tensor:
        return (self.w0 * g0).sum() + (self.w1 * g1).sum()


def fixed_grads() -> list[list]:
    gen = torch.Generator().manual_seed(1234)
    return [[torch.randn(3, generator=gen).tolist(), torch.randn(2, 2, generator=gen).tolist()]
            for _ in range(OPTIMIZER_STEPS)]


def ds_config(section: dict, scheduler: dict | None, allow_untested: bool = True) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": 3}, "optimizer": section, "steps_per_print": 10**9,
           "zero_allow_untested_optimizer": allow_untested}
    if scheduler is not None:
        cfg["scheduler"] = scheduler
    return cfg


def record_optimizer(name: str, section: dict, grads: list, scheduler: dict | None = None) -> dict:
    """deepspeed.initialize at ZeRO-3 on FixedGrads with two param groups, 5 engine steps."""
    import deepspeed
    from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS
    model = FixedGrads()
    groups = [{"params": [p], **opts} for p, opts in zip((model.w0, model.w1), GROUP_OPTIONS)]
    engine, _, _, lr_scheduler = deepspeed.initialize(model=model, model_parameters=groups,
                                                      config=ds_config(section, scheduler))
    basic = engine.basic_optimizer
    values, lrs = [], [[float(g["lr"]) for g in basic.param_groups]]
    for g0, g1 in grads:
        engine.backward(engine(torch.tensor(g0), torch.tensor(g1)))
        engine.step()
        with deepspeed.zero.GatheredParameters([model.w0, model.w1]):
            values.append([model.w0.detach().tolist(), model.w1.detach().tolist()])
        lrs.append([float(g["lr"]) for g in basic.param_groups])
    cls = type(basic)
    row = {"name": name, "section": section, "built": f"{cls.__module__}.{cls.__qualname__}",
           "adam_w_mode": getattr(basic, "adam_w_mode", None), "zero_tested": cls in ZERO_SUPPORTED_OPTIMIZERS,
           "defaults": {k: v for k, v in basic.defaults.items() if isinstance(v, (int, float, bool, list, tuple))
                        or v is None},
           "values": values}
    if scheduler is not None:
        row["scheduler"], row["lr"] = scheduler, lrs
    engine.destroy()
    return row


def untested_refusal() -> dict:
    """SGD at ZeRO-3 without zero_allow_untested_optimizer: the engine's assertion."""
    import deepspeed
    section = {"type": "SGD", "params": {"lr": 0.1}}
    try:
        deepspeed.initialize(model=FixedGrads(), config=ds_config(section, None, allow_untested=False))
    except Exception as e:  # noqa: BLE001 - recording what DeepSpeed raises
        return {"kind": "engine", "section": section, "deepspeed": f"{type(e).__name__}: {e}",
                "note": "without zero_allow_untested_optimizer: true"}
    return {"kind": "engine", "section": section, "deepspeed": None, "note": "accepted"}


class EngineStub:
    """What DeepSpeedEngine._configure_basic_optimizer reads, at ZeRO-3 without offload: the
    engine's own code runs on it, so a refusal is DeepSpeed's, without building an engine."""

    def __init__(self, section: dict) -> None:
        from deepspeed.runtime.engine import DeepSpeedEngine
        self.section, self.has_moe_layers, self.zenflow = section, False, False
        self.configure = DeepSpeedEngine._configure_basic_optimizer.__get__(self)
        self.get_optimizer_configuration = DeepSpeedEngine.get_optimizer_configuration.__get__(self)

    def optimizer_name(self) -> str:  # as DeepSpeedConfig._initialize_params lowercases it
        from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS
        name = self.section["type"]
        return name.lower() if name.lower() in DEEPSPEED_OPTIMIZERS else name

    def optimizer_params(self) -> dict | None:
        return self.section.get("params")

    def zero_use_cpu_optimizer(self) -> bool:
        return False

    def bf16_optimizer_states(self) -> bool:
        return False


def refusal(kind: str, section: dict, note: str | None) -> dict:
    try:
        if kind == "optimizer":
            EngineStub(section).configure([torch.nn.Parameter(torch.zeros(2))]).step()
        else:
            from deepspeed.runtime.engine import DeepSpeedEngine  # noqa: F401 - the engine's import order
            params = section.get("params")
            from deepspeed.runtime import lr_schedules
            getattr(lr_schedules, section["type"])(torch_optimizer("AdamW", [0.1]), **params)
    except Exception as e:  # noqa: BLE001 - recording what DeepSpeed raises
        return {"kind": kind, "section": section, "deepspeed": f"{type(e).__name__}: {e}"}
    return {"kind": kind, "section": section, "deepspeed": None, "note": note or "accepted"}


def compact_json(out: dict) -> str:
    """One line per table row, so the file stays small and a diff shows which row moved."""
    lines = []
    for key, value in out.items():
        if isinstance(value, list):
            rows = ",\n  ".join(json.dumps(row, separators=(",", ":")) for row in value)
            lines.append(f" {json.dumps(key)}: [\n  {rows}]")
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value, separators=(',', ':'))}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def main() -> None:
    import deepspeed
    init_one_rank()
    grads = fixed_grads()
    out = {"deepspeed": deepspeed.__version__, "torch": torch.__version__,
           "accelerator": os.environ["DS_ACCELERATOR"], "zero_stage": 3,
           "written": datetime.date.today().isoformat(), "by": "bench/deepspeed_records/deepspeed_schedules.py",
           "schedules": [record_schedule(*row) for row in SCHEDULES],
           "optimizer_setup": {"initial": INITIAL, "group_options": GROUP_OPTIONS, "grads": grads},
           "optimizers": [record_optimizer(row[0], row[1], grads, *row[2:]) for row in OPTIMIZERS],
           "refusals": [refusal("optimizer", s, None) for s in REFUSED_OPTIMIZERS]
           + [refusal("scheduler", s, note) for s, note in REFUSED_SCHEDULERS] + [untested_refusal()]}
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        f.write(compact_json(out))
    print(f"wrote {OUT} ({os.path.getsize(OUT)} bytes): {len(out['schedules'])} schedules, "
          f"{len(out['optimizers'])} optimizers, {len(out['refusals'])} refusals")
    for row in out["optimizers"]:
        print(f"  {row['name']:32s} {row['section']['type']:6s} -> {row['built']} adam_w_mode={row['adam_w_mode']}")
    for row in out["refusals"]:
        print(f"  refused {row['kind']:9s} {json.dumps(row['section'])}: {row['deepspeed']}")


if __name__ == "__main__":
    main()
