"""Issue #27 point 5: the 1.02 B GPT (bench/systems/common.py's b1) trained for 3 steps on 2 gloo
ranks under fz3.Init with the default Config (DeepSpeed's defaults) -- predicted first, and run
only when the prediction is within 20 GiB for both ranks.

    python3 bench/diagnostics/big_defaults.py          # sets up bench/.env if missing; writes its
                                                       # section of bench/RESULTS.md and
                                                       # bench/out/big_defaults.json
    python3 bench/diagnostics/big_defaults.py --smoke  # the same pipeline on tiny models (s2, then s3)

1. Plan: fz3.plan of both models with fz3.Config() (bench/diagnostics/plan_check.py's plan_of):
   the model states at their peak, per rank (shards, AdamW moments, and the peak of gathered
   params, grad partitions and held grads together).
2. Calibrate: the largest model below the target with the same width (m800: d 2048, 15 layers)
   trains the same 3 steps under the same Config (bench/diagnostics/memory.py's worker and
   launch: fz3.Init, AdamW, one batch again and again, MALLOC_MMAP_THRESHOLD_=131072). Its peak
   RSS above its own plan is what the plan does not count: the runtime, the activations,
   autograd's buffer of the tied embedding's first grad, the allocator. Guarded: its plan + 1 GiB
   per rank.
3. Predict the target: 2 ranks x (its plan + the calibration's excess). Run it only at or under
   20 GiB, and with that much (+1 GiB) available; else record why not.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)  # bench/: the harness (bench_env, compare, systems) and RESULTS.md, out/
sys.path[:0] = [HERE, BENCH]
if __name__ == "__main__":
    from bench_env import ensure_env
    ensure_env(__file__)

GiB = 2**30
CALIBRATION, TARGET = "m800", "b1"
SMOKE_CALIBRATION, SMOKE_TARGET = "s2", "s3"
CALIBRATION_GUARD = 1 * GiB  # per rank, above the calibration model's plan
SYSTEM = {"module": "fz3_z3", "options": {"config": {}, "init": True}}  # fz3.Config(): the defaults
BEGIN, END = "<!-- big_defaults:begin -->", "<!-- big_defaults:end -->"


def planned_peak(model: str) -> int:
    """fz3.plan's model states at the peak, per rank, of `model` on 2 ranks with fz3.Config()."""
    from plan_check import plan_of
    return max(s["model_state_peak_bytes"] for s in plan_of(model, 2, {}).steps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help=f"{SMOKE_CALIBRATION} then {SMOKE_TARGET}; no RESULTS.md")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per launch")
    ap.add_argument("--out", default=None, help="raw JSON (default bench/out/big_defaults.json)")
    args = ap.parse_args()
    import torch
    torch.set_num_threads(1)
    import memory
    from compare import machine_info, versions
    calibration, target = (SMOKE_CALIBRATION, SMOKE_TARGET) if args.smoke else (CALIBRATION, TARGET)
    out_path = args.out or os.path.join(BENCH, "out", "big_defaults_smoke.json" if args.smoke else "big_defaults.json")
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    t0 = time.time()
    res: dict = {"command": "python3 bench/diagnostics/big_defaults.py " + " ".join(sys.argv[1:]),
                 "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                 "machine": machine_info(), "versions": versions(), "calibration": calibration, "target": target,
                 "out_path": out_path}
    plan = {m: planned_peak(m) for m in (calibration, target)}
    params = {m: memory.count_params(m) for m in (calibration, target)}
    res.update(plan_bytes=plan, params=params)
    memory.log(f"plan, model states at the peak per rank: " +
               ", ".join(f"{m} ({params[m]:,} params) {plan[m] / GiB:.2f} GiB" for m in plan))

    guard = memory.WORLD * (plan[calibration] + CALIBRATION_GUARD)
    cal = memory.run_one("fz3-init", SYSTEM, calibration, params[calibration], guard, args.timeout)
    res["calibration_run"] = cal
    if cal["status"] != "ok":
        res["why"] = f"Target not run: the calibration run did not run ({cal['reason']})."
    else:
        excess = max(cal["peak_rss"]) - plan[calibration]
        predicted = memory.WORLD * (plan[target] + excess)
        res.update(excess_bytes=excess, predicted_bytes=predicted)
        memory.log(f"{calibration}: peak {max(cal['peak_rss']) / GiB:.2f} GiB a rank, {excess / GiB:.2f} above its "
                   f"plan; {target} predicted {predicted / GiB:.2f} GiB for both ranks")
        res["target_run"] = memory.run_one("fz3-init", SYSTEM, target, params[target], predicted, args.timeout)
    res["total_s"] = time.time() - t0
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1, default=str)
    section = render(res)
    print(section)
    if not args.smoke:
        from bench_env import replace_section
        replace_section(os.path.join(BENCH, "RESULTS.md"), section, BEGIN, END)
    runs = [res.get("calibration_run"), res.get("target_run")]
    return 1 if any(r is not None and r["status"] == "error" for r in runs) else 0


def render(res: dict) -> str:
    g = lambda b: f"{b / GiB:.2f}"  # noqa: E731
    v = res["versions"]
    lines = [BEGIN, "## The 1.02 B GPT with the default Config (issue #27 point 5)", "",
             f"`{res['command']}`, {res['date_utc']}, fz3 {v.get('fz3_git')}"
             f"{' (fz3/ modified)' if v.get('fz3_dirty') else ''}, torch {v['torch']}, {res['machine']['cores']} "
             f"cores, {res['machine']['mem_gib']} GiB; {res['total_s'] / 60:.0f} min.", "",
             "2 gloo ranks x 1 thread, the model built under fz3.Init, fz3.Config() (DeepSpeed's defaults: "
             "prefetch_bucket_size 5e7, max_live_parameters 1e9, max_reuse_distance 1e9, reduce_bucket_size "
             "5e8), torch AdamW fp32, seq 64, 1 sequence per rank, 3 steps on one batch, "
             "MALLOC_MMAP_THRESHOLD_=131072. Plan = fz3.plan's model states at the peak, per rank. "
             "Predicted = 2 x (plan + what the calibration model measured above its plan).", "",
             "| model | role | params | plan GiB/rank | predicted GiB (both ranks) | peak GiB (r0 / r1) "
             "| above plan GiB/rank | losses | steps s |",
             "|---|---|---:|---:|---:|---:|---:|---|---|"]
    for role, key in (("calibration", "calibration_run"), ("target", "target_run")):
        r = res.get(key)
        m = res[role]
        head = f"| {m} | {role} | {res['params'][m]:,} | {g(res['plan_bytes'][m])} |"
        if r is None:
            lines.append(head + " | not run | | | |")
        elif r["status"] != "ok":
            lines.append(head + f" {g(r['predicted_bytes'])} | {r['reason']} | | | |")
        else:
            lines.append(head + f" {g(r['predicted_bytes'])} | {' / '.join(g(b) for b in r['peak_rss'])} | "
                         f"{g(max(r['peak_rss']) - res['plan_bytes'][m])} | "
                         f"{', '.join(f'{x:.3f}' for x in r['losses'])} | "
                         f"{', '.join(f'{t:.1f}' for t in r['step_s'])} |")
    if res.get("why"):
        lines += ["", res["why"]]
    lines += ["", f"Raw records: {os.path.relpath(res['out_path'], os.path.dirname(BENCH))} (not in git).",
              END]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
