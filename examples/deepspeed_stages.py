"""A DeepSpeed training script across ZeRO stages, precisions and loss scaling, run unchanged by
DeepSpeed 0.19.8 and by fz3 (change its one import line, `import deepspeed`, to
`import fz3.deepspeed as deepspeed`).

    DS_ACCELERATOR=cpu bench/.env/bin/torchrun --nproc_per_node 2 examples/deepspeed_stages.py \
        --case fp32_stage2 --out /tmp/stages.json
    ... --case all --two-backwards --errors --out /tmp/stages.json    # what bench/ records

DeepSpeed's own run is tests/data/deepspeed_stages_0.19.8.json (bench/deepspeed_records/deepspeed_stages.sh, which
also skips DeepSpeed's 75 s shared-memory op build, and lets DeepSpeed's CPU accelerator run fp16:
it refuses fp16 on CPUs without AVX512-FP16). The script has three parts:

1. Training cases (CASES, or `--config PATH`): a tiny fixed-seed MLP regresses fixed synthetic
   data for 16 micro-steps (28 in the dynamic fp16 cases), gradient_accumulation_steps 2,
   gradient_clipping 1.0, AdamW from the JSON. Each case is one DeepSpeed JSON config: ZeRO stage
   0-3 in fp32, bf16 and fp16 (a dynamic loss scale whose first steps overflow and which grows
   back, dynamic with and without consecutive_hysteresis, static). A case may name micro-steps
   whose loss the script makes infinite on some ranks (`poison`), to force an overflow where it
   wants one. Every micro-step logs the loss (mean over ranks), the loss scale where DeepSpeed
   scripts read it (`engine.optimizer.loss_scale` / `.cur_scale`, as Megatron-DeepSpeed, BEiT and
   DeepSpeedExamples do), `engine.optimizer.overflow` (what Accelerate's `step_was_skipped`
   reads), `engine.skipped_steps`, `global_steps`, `was_step_applied()`, `get_lr()` and, where a
   step was applied, `get_global_grad_norm()`. At the end: [sum, norm] of each gathered parameter.
2. `--two-backwards`: several `engine.backward` calls before one `engine.step()`, per stage 0-3
   and gas 1 and 2, in three forms: plain, inside `engine.coalesce_grad_reduction()`, and with
   `"managed_gradient_accumulation": false`. Each records the error DeepSpeed raises or the
   parameters after, and which plain-PyTorch outcome (one process, whole batch, gradients summed
   by backward) they equal.
3. `--errors`: bad configs (fp16 and bf16 both on, a negative loss_scale, ZeRO stage 4 and -1,
   mics_shard_size, ...), the minimum loss scale reached, and each fp16 key set to "auto": the
   error and where it came, or what the engine then does.
"""
import deepspeed
import argparse
import copy
import json
import math
import os

import torch
import torch.distributed as dist

IN, HIDDEN, OUT = 8, 32, 4
MICRO = 4                    # rows per rank per micro-step
MICRO_STEPS = 16

BASE = {
    "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0, "steps_per_print": 10**9, "wall_clock_breakdown": False,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.9, 0.999], "eps": 1e-8,
                                              "weight_decay": 0.01, "torch_adam": True}},
    "zero_optimization": {"stage": 2},
}
# WarmupDecayLR in the dynamic fp16 cases: a skipped step does not step the scheduler
SCHEDULER = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                 "warmup_num_steps": 2, "total_num_steps": 14,
                                                 "warmup_type": "linear"}}


def case(stage: int, precision: str = "fp32", *, scheduler: bool = False, probe: float = 0.0, poison=None,
         micro_steps: int = MICRO_STEPS, **fp16) -> dict:
    """One training case: a DeepSpeed config; the overflow probe's c ([Note: the overflow
    probe]); the micro-steps whose loss the script makes infinite, {micro_step: [ranks]}."""
    cfg = copy.deepcopy(BASE)
    cfg["zero_optimization"] = {"stage": stage}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, **fp16}
    if scheduler:
        cfg["scheduler"] = copy.deepcopy(SCHEDULER)
    return {"config": cfg, "probe": probe, "poison": {str(k): v for k, v in (poison or {}).items()},
            "micro_steps": micro_steps}


# Dynamic scaling from DeepSpeed's default 2**16 with the probe at c = 8: steps overflow while
# the scale is >= 2**14. Hysteresis 2 spends the first overflow without halving, so boundaries
# 0-3 skip (2**16, 2**16, 2**15, 2**14) and 2**13 trains; a window of 3 grows it back to 2**14
# at boundary 7, which overflows twice (hysteresis refilled by the growth) and halves again.
OVERFLOWING = dict(loss_scale=0, initial_scale_power=16, loss_scale_window=3, hysteresis=2, min_loss_scale=1)
PROBE = 8.0
# Overflows forced at boundaries 1, 3 and 6 (micro-steps 3, 7, 13; rank 1 only) at a scale far
# below the probe's: with hysteresis 2, consecutive_hysteresis decides whether they halve it.
FORCED = {3: [1], 7: [1], 13: [1]}
STEADY = dict(loss_scale=0, initial_scale_power=8, loss_scale_window=4, hysteresis=2, min_loss_scale=1)
NAN_AT_5 = {5: [0]}

CASES = {
    **{f"fp16_dynamic_overflow_stage{s}": case(s, "fp16", scheduler=True, probe=PROBE, micro_steps=28, **OVERFLOWING)
       for s in (0, 1, 2, 3)},
    "fp16_dynamic_hysteresis1_stage2": case(2, "fp16", probe=PROBE, micro_steps=28, **{**OVERFLOWING, "hysteresis": 1}),
    # hysteresis 0 is accepted, and then an overflow never halves the scale (it only counts down)
    "fp16_dynamic_hysteresis0_stage2": case(2, "fp16", probe=PROBE, micro_steps=8, **{**OVERFLOWING, "hysteresis": 0}),
    **{f"fp16_hysteresis_stage{s}": case(s, "fp16", poison=FORCED, consecutive_hysteresis=False, **STEADY)
       for s in (2, 3)},
    **{f"fp16_consecutive_hysteresis_stage{s}": case(s, "fp16", poison=FORCED, consecutive_hysteresis=True, **STEADY)
       for s in (2, 3)},
    **{f"fp16_static_stage{s}": case(s, "fp16", scheduler=True, loss_scale=128) for s in (0, 1, 2, 3)},
    "fp16_static_nan_stage2": case(2, "fp16", poison=NAN_AT_5, loss_scale=128),
    "fp16_default_scaler_stage2": case(2, "fp16"),
    **{f"fp32_stage{s}": case(s) for s in (0, 1, 2, 3)},
    **{f"bf16_stage{s}": case(s, "bf16") for s in (0, 1, 2, 3)},
    **{f"fp32_nan_stage{s}": case(s, poison=NAN_AT_5) for s in (0, 1, 2, 3)},
    **{f"bf16_nan_stage{s}": case(s, "bf16", poison=NAN_AT_5) for s in (0, 2, 3)},
}


class MLP(torch.nn.Module):
    """x (B, 8) -> (B, 4); forward returns the mean squared error against y, in fp32 (as HF
    models upcast logits before the loss), plus `probe_grad * probe`.

    [Note: the overflow probe] `probe` is one parameter that stays 0: the script passes
    probe_grad = [+c] or [-c] (a tensor, like the batch), alternating over ranks and micro-steps,
    so its gradient sums to exactly 0 over ranks and over a window, and its fp16 gradient on one
    rank is c * scale / gas: with c = 8 and gas 2, fp16 overflows exactly when the loss scale
    reaches 2**14 (4 * 2**14 = 65536 rounds to inf). The model's own gradients stay far below
    fp16's range at 2**13 (even summed over ranks and micro-steps), so whether a step overflows
    depends on the scale alone, not on rounding: an implementation that sums fp16 gradients in
    another order, or in fp32, sees the same overflows as DeepSpeed. (Without the probe, this
    model's first fp16 overflows fall within 5% of fp16's limit: a knife edge.)
    """

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(IN, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, OUT)
        self.probe = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor, y: torch.Tensor, probe_grad: torch.Tensor | None = None) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.fc1(x))   # (B, 32)
        h = torch.nn.functional.gelu(self.fc2(h))   # (B, 32)
        mse = torch.nn.functional.mse_loss(self.head(h).float(), y)
        if probe_grad is None:
            return mse
        return mse + (probe_grad * self.probe.float()).sum()   # probe_grad (1,), fp32


def synthetic_data(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rows on every rank: x (rows, 8) standard normal, y = 3 sin(x @ W) (rows, 4)."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(rows, IN, generator=g)
    w = torch.randn(IN, OUT, generator=g)
    return x, 3.0 * torch.sin(x @ w)


DATA = synthetic_data(64 * 2 * MICRO)


def micro_batch(step: int, rank: int, world: int, dtype: torch.dtype):
    """Global micro-step `step` covers rows [step*world*MICRO, (step+1)*world*MICRO); this rank
    takes its own MICRO of them, inputs in the compute dtype."""
    start = (step * world + rank) * MICRO
    return DATA[0][start:start + MICRO].to(dtype), DATA[1][start:start + MICRO]


def compute_dtype(cfg: dict) -> torch.dtype:
    """The inputs' dtype, as a script's --fp16 / --bf16 flag decides it (`"enabled": "auto"` is
    not a flag the script sets)."""
    if cfg.get("fp16", {}).get("enabled") is True:
        return torch.float16
    return torch.bfloat16 if cfg.get("bf16", {}).get("enabled") is True else torch.float32


def mean_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def plain(v):
    """JSON-friendly: tensors to floats, non-finite floats to strings."""
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, (list, tuple)):
        return [plain(x) for x in v]
    return v


def error_record(e: Exception) -> dict:
    return {"type": type(e).__name__, "message": str(e)[:600]}


# ---------------------------------------------------------------- 1. training cases

SCALE_READS = ("loss_scale", "cur_scale", "overflow")


def scale_reads(engine) -> dict:
    """The loss scale and overflow flag where DeepSpeed scripts read them; absent names omitted."""
    opt = engine.optimizer
    return {f"optimizer.{n}": plain(getattr(opt, n)) for n in SCALE_READS if hasattr(opt, n)}


SCALER_FIELDS = ("cur_scale", "dynamic", "scale_factor", "scale_window", "min_scale", "delayed_shift",
                 "cur_hysteresis", "consecutive_hysteresis", "cur_iter", "last_overflow_iter")


def scaler_fields(engine) -> dict:
    """DeepSpeed's own scaler state (engine.optimizer.loss_scaler, or FP16_UnfusedOptimizer's
    loss_scale_config): internals, recorded where they exist, absent elsewhere."""
    scaler = getattr(engine.optimizer, "loss_scaler", None) or getattr(engine.optimizer, "loss_scale_config", None)
    if scaler is None:
        return {}
    return {"class": type(scaler).__name__,
            **{f: plain(getattr(scaler, f)) for f in SCALER_FIELDS + ("dynamic_loss_scale", "min_loss_scale")
               if hasattr(scaler, f)}}


def build(cfg: dict):
    torch.manual_seed(0)
    model = MLP()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def train_case(spec: dict, record: dict) -> None:
    """Train one case, appending a row per micro-step to record["rows"] (kept if a step raises)."""
    cfg, poison = spec["config"], spec.get("poison", {})
    engine = build(cfg)
    record["initialized"] = True
    record["scaler_at_start"] = scaler_fields(engine)
    rank, world, dtype = dist.get_rank(), dist.get_world_size(), compute_dtype(cfg)
    for i in range(spec.get("micro_steps", MICRO_STEPS)):
        before = scale_reads(engine)
        x, y = micro_batch(i, rank, world, dtype)
        c = spec.get("probe", 0.0)
        probe_grad = torch.tensor([c if (rank + i) % 2 == 0 else -c])   # data, like x: it differs by rank
        loss = engine(x, y, probe_grad)
        value = loss.item()
        if rank in poison.get(str(i), []):
            loss = loss * float("inf")     # an overflow on this rank only
        engine.backward(loss)
        engine.step()
        applied = engine.was_step_applied()
        record["rows"].append({
            "micro_step": i, "loss": plain(mean_over_ranks(value)), "poisoned_ranks": poison.get(str(i), []),
            "scale_before": before, "scale_after": scale_reads(engine), "was_step_applied": applied,
            "skipped_steps": engine.skipped_steps, "global_steps": engine.global_steps, "lr": plain(engine.get_lr()),
            "grad_norm": plain(engine.get_global_grad_norm()) if applied else None})
        if rank == 0:
            r = record["rows"][-1]
            print(f"micro {i} loss {r['loss']} scale {r['scale_after'].get('optimizer.loss_scale')} "
                  f"applied {applied} skipped {r['skipped_steps']} norm {r['grad_norm']}", flush=True)
    record["params_final"] = final_params(engine)
    record["reads_at_end"] = {**scale_reads(engine), "skipped_steps": engine.skipped_steps,
                              "optimizer_type": type(engine.optimizer).__name__}


def final_params(engine) -> dict:
    """name -> [sum, norm] of each gathered parameter (float64), the same on every rank."""
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        return {n: [p.double().sum().item(), p.double().norm().item()] for n, p in engine.module.named_parameters()}


def run_case(spec: dict) -> dict:
    record = {"config": spec["config"], "probe": spec.get("probe", 0.0), "poison": spec.get("poison", {}), "rows": []}
    try:
        train_case(spec, record)
    except Exception as e:  # noqa: BLE001 - a refused case is a recorded fact
        at = f"micro-step {len(record['rows'])}" if record.get("initialized") else "initialize"
        record["error"] = {**error_record(e), "at": at}
    return record


# ---------------------------------------------------------------- 2. two backwards, one step

TWO_BACKWARD_FORMS = ("plain", "coalesce", "unmanaged")


def two_backwards_config(stage: int, gas: int, form: str) -> dict:
    cfg = copy.deepcopy(BASE)
    cfg["gradient_accumulation_steps"] = gas
    cfg["zero_optimization"] = {"stage": stage}
    if form == "unmanaged":
        cfg["managed_gradient_accumulation"] = False
    return cfg


def two_backwards(engine, gas: int, form: str) -> list:
    """`gas` rounds of: forward+backward on micro-batch 2k, forward+backward on 2k+1, step()."""
    rank, world = dist.get_rank(), dist.get_world_size()
    applied = []
    for k in range(gas):
        def both():
            for j in (2 * k, 2 * k + 1):
                engine.backward(engine(*micro_batch(j, rank, world, torch.float32)))
        if form == "coalesce":
            with engine.coalesce_grad_reduction():
                both()
        else:
            both()
        engine.step()
        applied.append(engine.was_step_applied())
    return applied


def reference(gas: int, steps_after: list) -> dict:
    """Plain PyTorch in one process: the whole batch of each micro-step (all ranks' rows, loss
    averaged over ranks as DeepSpeed averages gradients), each loss / gas, gradients summed by
    backward; AdamW with clip_grad_norm_(1.0) after the micro-steps listed per step."""
    torch.manual_seed(0)
    model = MLP()
    o = BASE["optimizer"]["params"]
    opt = torch.optim.AdamW(model.parameters(), lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"],
                            weight_decay=o["weight_decay"])
    world = dist.get_world_size()
    for micro_steps in steps_after:
        for j in micro_steps:
            for r in range(world):
                (model(*micro_batch(j, r, world, torch.float32)) / (gas * world)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), BASE["gradient_clipping"])
        opt.step()
        opt.zero_grad()
    return {n: p.detach().double() for n, p in model.named_parameters()}


def compare(engine, refs: dict) -> dict:
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        got = {n: p.detach().double().clone() for n, p in engine.module.named_parameters()}
    diffs = {name: max((got[n] - ref[n]).abs().max().item() for n in ref) for name, ref in refs.items()}
    closest = min(diffs, key=diffs.get)
    return {"params_final": {n: [t.sum().item(), t.norm().item()] for n, t in got.items()},
            "matches": [name for name, d in diffs.items() if d < 1e-5],
            "closest": closest, "closest_max_abs_diff": diffs[closest]}


def two_backwards_references(gas: int) -> dict:
    """Candidate outcomes, each plain PyTorch: one AdamW step on any non-empty subset of the
    2*gas micro-batches ("one_step_on_0+1+3"), or a step after each round ("step_per_round")."""
    n = 2 * gas
    refs = {"step_per_round": reference(gas, [[2 * k, 2 * k + 1] for k in range(gas)])}
    for mask in range(1, 2 ** n):
        subset = [j for j in range(n) if mask >> j & 1]
        refs["one_step_on_" + "+".join(map(str, subset))] = reference(gas, [subset])
    return refs


def two_backwards_section() -> dict:
    out = {"what": "gas rounds of: backward(micro-batch 2k), backward(micro-batch 2k+1), step(). 'matches' "
                   "names the plain-PyTorch outcomes the parameters equal (max abs diff < 1e-5): "
                   "one_step_on_S = one AdamW step (clip 1.0) on the micro-batches in S, each loss / gas, "
                   "gradients summed; step_per_round = a step after each round on its 2 micro-batches",
           "runs": {}}
    for gas in (1, 2):
        refs = two_backwards_references(gas)
        for stage in (0, 1, 2, 3):
            for form in TWO_BACKWARD_FORMS:
                cfg = two_backwards_config(stage, gas, form)
                row = {"config": cfg}
                try:
                    engine = build(cfg)
                except Exception as e:  # noqa: BLE001
                    row["error"] = {**error_record(e), "at": "initialize"}
                else:
                    try:
                        row["was_step_applied"] = two_backwards(engine, gas, form)
                        row["global_steps"] = engine.global_steps
                        row.update(compare(engine, refs))
                    except Exception as e:  # noqa: BLE001
                        row["error"] = {**error_record(e), "at": "training"}
                out["runs"][f"stage{stage}_gas{gas}_{form}"] = row
                if dist.get_rank() == 0:
                    print(f"two_backwards stage{stage} gas{gas} {form}: {row.get('error') or row['matches']} "
                          f"(closest {row.get('closest')})", flush=True)
    return out


# ---------------------------------------------------------------- 3. bad configs and "auto"

def fp16_config(stage: int = 2, **fp16) -> dict:
    return case(stage, "fp16", **fp16)["config"]


BAD_CONFIGS = {
    "fp16_and_bf16": {**fp16_config(), "bf16": {"enabled": True}},
    "fp16_loss_scale_negative": fp16_config(loss_scale=-1),
    "fp16_loss_scale_window_zero": fp16_config(loss_scale_window=0),
    "fp16_min_loss_scale_zero": fp16_config(min_loss_scale=0),
    "stage_4": {**BASE, "zero_optimization": {"stage": 4}},
    "stage_minus_1": {**BASE, "zero_optimization": {"stage": -1}},
    "mics_shard_size": {**BASE, "zero_optimization": {"stage": 3, "mics_shard_size": 2}},
    "bf16_stage0_fp32_grad_accum": {**case(0, "bf16")["config"], "data_types": {"grad_accum_dtype": "fp32"}},
    "coalesce_with_unmanaged": {**BASE, "managed_gradient_accumulation": False},
    "unmanaged_stage1_overlap_comm": {**BASE, "managed_gradient_accumulation": False,
                                      "zero_optimization": {"stage": 1, "overlap_comm": True}},
}
# every rank poisoned every step: the scale halves to min_loss_scale (2), then the next overflow
# at the minimum raises
MIN_SCALE_CASE = case(2, "fp16", poison={i: [0, 1] for i in range(MICRO_STEPS)}, loss_scale=0,
                      initial_scale_power=3, hysteresis=1, min_loss_scale=2)
FP16_KEYS = ("enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
             "consecutive_hysteresis", "min_loss_scale")


def errors_section() -> dict:
    out = {}
    for name, cfg in BAD_CONFIGS.items():
        try:
            engine = build(cfg)
        except Exception as e:  # noqa: BLE001
            out[name] = {"config": cfg, "error": {**error_record(e), "at": "initialize"}}
            continue
        row = {"config": cfg, "initialized": True, "optimizer_type": type(engine.optimizer).__name__}
        try:
            x, y = micro_batch(0, dist.get_rank(), dist.get_world_size(), compute_dtype(cfg))
            if name == "coalesce_with_unmanaged":
                with engine.coalesce_grad_reduction():
                    engine.backward(engine(x, y))
            else:
                engine.backward(engine(x, y))
            engine.step()
            row["one_micro_step"] = "ok"
        except Exception as e:  # noqa: BLE001
            row["error"] = {**error_record(e), "at": "training"}
        out[name] = row
    out["min_loss_scale_reached"] = run_case(MIN_SCALE_CASE)
    return out


# Every fp16 key away from its default (and a static loss_scale when "auto" replaces it), so
# that what "auto" reads as shows in the run and in the scaler's fields
AUTO_BASE = dict(loss_scale=0, initial_scale_power=15, loss_scale_window=3, hysteresis=1,
                 consecutive_hysteresis=True, min_loss_scale=2)


def auto_section() -> dict:
    """Each fp16 key set to "auto" alone: the scale sequence (and, under DeepSpeed, its scaler's
    fields) shows what it was read as."""
    out = {"base": AUTO_BASE}
    for key in FP16_KEYS:
        fp16 = {**AUTO_BASE, "loss_scale": 128 if key == "loss_scale" else 0, key: "auto"}
        out[f"fp16.{key}"] = run_case(case(2, "fp16", probe=PROBE, **fp16))
    return out


# ---------------------------------------------------------------- main

def main() -> None:
    parser = argparse.ArgumentParser(description="DeepSpeed stages / fp16 / several-backwards script")
    parser.add_argument("--local_rank", type=int, default=-1, help="passed by the deepspeed launcher")
    parser.add_argument("--case", action="append", default=[], help=f"'all' or one of {sorted(CASES)}")
    parser.add_argument("--config", default=None, help="a DeepSpeed JSON config, run as case 'custom'")
    parser.add_argument("--two-backwards", action="store_true", help="part 2: several backwards per step")
    parser.add_argument("--errors", action="store_true", help="part 3: bad configs and fp16 'auto'")
    parser.add_argument("--out", default=None, help="write the record as JSON (rank 0)")
    args = parser.parse_args()

    deepspeed.init_distributed()
    names = sorted(CASES) if "all" in args.case else args.case
    cases = {n: CASES[n] for n in names}
    if args.config:
        with open(args.config) as f:
            cases["custom"] = {"config": json.load(f), "poison": {}}
    record = {"deepspeed_version": getattr(deepspeed, "__version__", None), "world_size": dist.get_world_size(),
              "micro_batch_per_rank": MICRO, "cases": {}}
    for name, spec in cases.items():
        if dist.get_rank() == 0:
            print(f"== case {name}", flush=True)
        record["cases"][name] = run_case(spec)
    if args.two_backwards:
        record["two_backwards"] = two_backwards_section()
    if args.errors:
        record["errors"] = errors_section()
        record["auto"] = auto_section()

    if dist.get_rank() == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
        print(f"wrote {args.out}", flush=True)
    # torch 2.13 + gloo can abort a rank during interpreter shutdown (docs/environment.md): end cleanly
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
