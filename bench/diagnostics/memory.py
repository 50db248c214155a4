"""Memory as the headline: peak RSS per rank of DDP, FSDP2, DeepSpeed ZeRO-3 and fz3 on 2 local
gloo ranks, the bytes per parameter it implies, and the largest GPT each fits in 20 GiB.

    python3 bench/diagnostics/memory.py          # sets up bench/.env if missing, runs everything,
                                                 # writes its section of bench/RESULTS.md
                                                 # + bench/out/memory.json
    python3 bench/diagnostics/memory.py --smoke  # the whole pipeline on tiny models (about 2 min);
                                                 # bench/out/memory_smoke.json, RESULTS.md only
                                                 # with --md
    python3 bench/diagnostics/memory.py --only ddp,fz3 --sizes m100,m300 --no-big

1. Each system trains the same GPT (bench/systems/common.py MODELS: m100, 0.11 B params, and
   m300, 0.34 B; seq 64, one sequence per rank) for 3 steps with torch AdamW, fp32, 2 ranks x 1
   intra-op thread, one launch per system and size, with MALLOC_MMAP_THRESHOLD_=131072 (else
   glibc keeps freed memory mapped and peak RSS counts it). Per rank: ru_maxrss right after the
   build (model built and wrapped / fz3.initialize returned, before the first step: the
   construction peak) and after the last step (the peak). Bytes per parameter per rank is the
   slope of the larger rank's peak between the sizes, (peak_big - peak_small) / (params_big -
   params_small), with its intercept; beside theory: 16 B/param (4 param + 4 grad + 8 Adam)
   per rank for DDP, 16 / N = 8 for ZeRO-3 with N = 2 (FSDP2, DeepSpeed, fz3).
   fz3 runs twice: plain ("fz3") and with its model built under fz3.Init ("fz3-init").
2. The largest GPT each system fits in 20 GiB for both ranks: (10 GiB - intercept) / slope.
3. fz3 with fz3.Init trains the largest model of the ladder (m600, m800, b1, b12: 0.62 to 1.23 B
   params) that the fitted line puts within 20 GiB for both ranks, for 3 steps: its construction
   peak and step peak per rank, and the losses.

Safety: an out-of-memory kill takes the machine down, so every launch is first predicted and
skipped (recorded "skipped: predicted X GiB") above 20 GiB for both ranks together, or when the
machine has less available. Fit sizes: theory B/param/rank (DDP 16, FSDP2 and fz3 8, DeepSpeed 10:
assume an extra fp32 copy on CPU) x params x 1.5 + 1 GiB per rank, or, when larger, the peak of
the same system at a smaller size x the params ratio x 1.1. The big run: the fitted fz3 line
(fz3-init's when measured, else plain fz3's; its slope no less than 8 B/param) x 1.05.

Every step trains on the same batch (step 0's of bench/systems/common.py `batches`), so that 3
steps of a fresh model show a falling loss if training works: with a new batch each step, 3 steps
of the 0.1 B model stay within batch-to-batch noise (DDP: 10.559, 10.629, 10.549).

ZeRO-3 settings, one dict for fz3 and DeepSpeed: bench/systems/deepspeed_z3.py's DS_ZERO with
reduce_bucket_size, stage3_prefetch_bucket_size, stage3_max_live_parameters and
stage3_max_reuse_distance 5e7 (below the models' size, so the fit sees bytes per parameter, not a
bucket or a live budget growing with the model up to their 5e8 / 1e9 defaults, which would keep
a 1 B model's full params gathered from forward to backward); fz3 gets
fz3.Config.from_deepspeed of the same DeepSpeed config. FSDP2 and DDP as in bench/systems/.
The log goes to stdout.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)  # bench/: the harness (bench_env, compare, systems) and RESULTS.md, out/
ROOT = os.path.dirname(BENCH)
GiB = 2**30
LIMIT = 20 * GiB  # both ranks together
WORLD, STEPS = 2, 3
MMAP_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}
SIZES, LADDER = ["m100", "m300"], ["m600", "m800", "b1", "b12"]
SMOKE_SIZES, SMOKE_LADDER = ["s1", "s2"], ["s3"]
GUARD_FACTOR, GUARD_PER_RANK = 1.5, 1 * GiB  # fit sizes: theory x 1.5 + 1 GiB per rank, or ...
EXTRAP_FACTOR = 1.1  # ... a smaller size's peak x the params ratio x 1.1, whichever is larger
BIG_FACTOR, BIG_MIN_SLOPE = 1.05, 8.0  # big run: measured line x 1.05 (~1 GiB at 20), slope >= 8
AVAILABLE_SPARE = 1 * GiB  # a launch also needs this much more than predicted to be available


sys.path[:0] = [HERE, BENCH]  # systems.*, compare (spawned ranks inherit sys.path)
if __name__ == "__main__":
    from bench_env import ensure_env
    ensure_env(__file__)


def zero_dict() -> dict:
    from systems.deepspeed_z3 import DS_ZERO
    return {**DS_ZERO, "reduce_bucket_size": 50_000_000, "stage3_prefetch_bucket_size": 50_000_000,
            "stage3_max_live_parameters": 50_000_000, "stage3_max_reuse_distance": 50_000_000}


def systems_table() -> dict[str, dict]:
    """label -> {module, options, theory: ZeRO theory B/param/rank, guard: B/param/rank assumed
    by the pre-launch prediction}."""
    from fz3 import Config
    from systems.deepspeed_z3 import ds_config
    with warnings.catch_warnings():  # the DeepSpeed keys fz3 accepts but does not use
        warnings.simplefilter("ignore")
        fields = dataclasses.asdict(Config.from_deepspeed(ds_config("m100", WORLD, zero_dict())))
    return {
        "ddp": {"module": "ddp", "options": {}, "theory": 16, "guard": 16},
        "fsdp2": {"module": "fsdp2", "options": {}, "theory": 8, "guard": 8},
        "deepspeed": {"module": "deepspeed_z3", "options": {"zero": zero_dict()}, "theory": 8, "guard": 10},
        "fz3": {"module": "fz3_z3", "options": {"config": fields}, "theory": 8, "guard": 8},
        "fz3-init": {"module": "fz3_z3", "options": {"config": fields, "init": True}, "theory": 8, "guard": 8},
    }


def count_params(model: str) -> int:
    """Exact parameter count (the tied embedding once), built on the meta device: no memory."""
    return sum(p.numel() for p in _meta_gpt(model).parameters())


def largest_module_params(model: str) -> int:
    """The most params one module holds itself (a fetch unit: the embedding, for these GPTs)."""
    return max(sum(p.numel() for p in m.parameters(recurse=False)) for m in _meta_gpt(model).modules())


def _meta_gpt(model: str):
    import torch

    from systems.common import MODELS
    from gpt import GPT  # examples/gpt.py (systems put it on the path)
    with torch.device("meta"):
        return GPT(MODELS[model][0])


def construction_target(model: str) -> int:
    """Issue #11's bound on fz3.Init's construction peak per rank: 1/N of the model (fp32) + its
    largest module + 300 MB."""
    return count_params(model) * 4 // WORLD + largest_module_params(model) * 4 + 300 * 2**20


def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def fz3_has_init() -> bool:
    import fz3
    return hasattr(fz3, "Init")


def worker(rank: int, world: int, module: str, spec: dict) -> dict:
    """One rank: build the system, read the construction peak, run the steps, read the peak."""
    import importlib

    from systems.common import batches, peak_rss_bytes, rss_bytes
    t0 = time.perf_counter()
    sysobj = importlib.import_module(f"systems.{module}").build(rank, world, spec)
    out = {"rank": rank, "build_s": time.perf_counter() - t0,
           "build_peak_rss": peak_rss_bytes(), "build_rss": rss_bytes(),  # ru_maxrss only grows: now
           **getattr(sysobj, "construction", {})}
    losses, times = [], []
    for x, y in batches(spec["model"], rank, world, 1) * spec["steps"]:  # one batch, again and again
        t0 = time.perf_counter()
        losses.append(sysobj.step(x, y))
        times.append(time.perf_counter() - t0)
    out.update(losses=losses, times=times, peak_rss=peak_rss_bytes(), rss=rss_bytes())
    return out


def launch(module: str, spec: dict, timeout: float) -> list[dict]:
    """fz3.launch.run of `worker` on WORLD ranks x 1 thread, with MMAP_ENV in the ranks' environment."""
    import fz3.launch
    saved = {k: os.environ.get(k) for k in MMAP_ENV}
    os.environ.update(MMAP_ENV)
    try:
        return fz3.launch.run(worker, world_size=WORLD, args=(module, spec), timeout=timeout, threads=1)
    finally:  # put the environment back
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_one(label: str, system: dict, model: str, params: int, predicted: int, timeout: float) -> dict:
    """One launch (or its reason not to): the record that memory.json and the tables use."""
    rec = {"label": label, "model": model, "params": params, "predicted_bytes": predicted}
    avail = available_bytes()
    if predicted > LIMIT:
        rec.update(status="skipped", reason=f"skipped: predicted {predicted / GiB:.1f} GiB")
    elif predicted + AVAILABLE_SPARE > avail:
        rec.update(status="skipped", reason=f"skipped: predicted {predicted / GiB:.1f} GiB, "
                                            f"only {avail / GiB:.1f} GiB available")
    elif system["options"].get("init") and not fz3_has_init():
        rec.update(status="error", reason="error: fz3.Init does not exist in this fz3 yet")
    if "status" in rec:
        log(f"{label:9s} {model:5s} {rec['reason']}")
        return rec
    spec = {"model": model, "steps": STEPS, "mode": "time", "options": system["options"]}
    log(f"{label:9s} {model:5s} {params:,} params, predicted {predicted / GiB:.1f} GiB for both ranks ...")
    t0 = time.time()
    try:
        out = launch(system["module"], spec, timeout)
    except Exception as e:  # noqa: BLE001 - record it, go on with the other runs
        first = [ln for ln in str(e).splitlines() if ln.strip()]
        rec.update(status="error", reason="error: " + (first[-1] if first else type(e).__name__),
                   traceback=str(e), wall_s=time.time() - t0)
        log(f"{label:9s} {model:5s} {rec['reason']}")
        return rec
    losses = [sum(r["losses"][i] for r in out) / len(out) for i in range(STEPS)]  # equal local batches
    rec.update(status="ok", wall_s=time.time() - t0, ranks=out, losses=losses,
               falling=losses[-1] < losses[0],
               peak_rss=[r["peak_rss"] for r in out], build_peak_rss=[r["build_peak_rss"] for r in out],
               init_peak_rss=[r.get("init_peak_rss") for r in out],
               build_s=max(r["build_s"] for r in out), step_s=[max(r["times"][i] for r in out) for i in range(STEPS)])
    log(f"{label:9s} {model:5s} peak RSS {[f'{b / GiB:.2f}' for b in rec['peak_rss']]} GiB, after build "
        f"{[f'{b / GiB:.2f}' for b in rec['build_peak_rss']]} GiB, losses {[f'{v:.3f}' for v in losses]}, "
        f"{rec['wall_s']:.0f} s")
    return rec


def fit(runs: list[dict]) -> dict | None:
    """Least-squares line of the larger rank's peak RSS over params (with two sizes: the slope
    between them). -> {slope: B/param/rank, intercept: bytes/rank} or None (under two sizes)."""
    pts = [(r["params"], max(r["peak_rss"])) for r in runs if r["status"] == "ok"]
    if len({p for p, _ in pts}) < 2:
        return None
    mx, my = sum(p for p, _ in pts) / len(pts), sum(b for _, b in pts) / len(pts)
    slope = sum((p - mx) * (b - my) for p, b in pts) / sum((p - mx) ** 2 for p, _ in pts)
    return {"slope": slope, "intercept": my - slope * mx, "points": pts}


def largest_params(line: dict) -> int | None:
    """Params that the line puts at LIMIT / WORLD per rank; None when it does not grow."""
    if line is None or line["slope"] <= 0:
        return None
    return int((LIMIT / WORLD - line["intercept"]) / line["slope"])


def predict_big(line: dict, params: int) -> int:
    """Both ranks, the fitted line with a slope of at least BIG_MIN_SLOPE, x BIG_FACTOR."""
    per_rank = line["intercept"] + max(line["slope"], BIG_MIN_SLOPE) * params
    return int(WORLD * per_rank * BIG_FACTOR)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.2f}] {msg}", flush=True)


# ---- the RESULTS.md section ---------------------------------------------------------------------
BEGIN, END = "<!-- memory:begin -->", "<!-- memory:end -->"


def _gib(b) -> str:
    return f"{b / GiB:.2f}"


def _pair(rec: dict, key: str) -> str:
    if rec is None:
        return "not run"
    if rec["status"] != "ok":
        return rec["reason"]
    return " / ".join(_gib(b) for b in rec[key])


def render(res: dict) -> str:
    v, s = res["versions"], res["settings"]
    runs = res["runs"]
    sizes = s["sizes"]
    params = res["params"]
    find = {(r["label"], r["model"]): r for r in runs}
    out = [BEGIN, "## Memory: peak RSS per rank, bytes per parameter, the largest GPT in 20 GiB", "",
           f"`{res['command']}`, {res['date_utc']}, fz3 {v.get('fz3_git')}"
           f"{' (fz3/ modified)' if v.get('fz3_dirty') else ''}, torch {v['torch']}, DeepSpeed {v.get('deepspeed')}, "
           f"{res['machine']['cpu']}, {res['machine']['cores']} cores, {res['machine']['mem_gib']} GiB; "
           f"{res['total_s'] / 60:.0f} min.", "",
           f"{s['world']} gloo ranks x 1 intra-op thread; torch AdamW fp32 (lr 1e-3, weight decay 0.01); "
           f"GPT with tied embedding, seq 64, global batch 2 (1 per rank); {s['steps']} steps per launch, "
           f"all on the same batch (so the loss falls if training works); one launch per system and size; "
           f"MALLOC_MMAP_THRESHOLD_=131072. Peak = ru_maxrss of each "
           "rank after the last step; after build = ru_maxrss once the model is built and wrapped "
           "(fz3.initialize returned), before the first step. fz3-init builds the model under fz3.Init(). "
           "ZeRO-3 settings (fz3 and DeepSpeed): bench/systems/deepspeed_z3.py's DS_ZERO with "
           "reduce_bucket_size, stage3_prefetch_bucket_size, stage3_max_live_parameters and "
           "stage3_max_reuse_distance 5e7 (below the models, so that the fit measures bytes per "
           "parameter, not a bucket or live budget that grows with the model to its 5e8 / 1e9 default); "
           "fz3 runs fz3.Config.from_deepspeed of the same DeepSpeed config. FSDP2: fully_shard per "
           "block + root; DDP: default buckets.", "",
           "### (a) Peak RSS per rank (GiB, rank 0 / rank 1) and bytes per parameter per rank", "",
           "| system | " + " | ".join(f"{m} ({params[m]:,} params)" for m in sizes)
           + " | fitted B/param/rank | intercept GiB/rank | theory B/param/rank |",
           "|---|" + "---:|" * len(sizes) + "---:|---:|---:|"]
    for label in s["labels"]:
        line = res["fits"].get(label)
        cells = [_pair(find.get((label, m)), "peak_rss") for m in sizes]
        fitted = (f"{line['slope']:.2f}", _gib(line["intercept"])) if line else ("n/a", "n/a")
        out.append(f"| {label} | " + " | ".join(cells) + f" | {fitted[0]} | {fitted[1]} | "
                   f"{res['theory'][label]} |")
    out += ["", "Theory: fp32 AdamW keeps 16 B/param (4 param + 4 grad + 8 Adam moments); DDP keeps all of "
            "it on every rank, ZeRO-3 shards it over N = 2 ranks: 8 B/param/rank. The fit uses the larger "
            "rank's peak.", "",
            "Each run (after build = the construction peak; GiB, rank 0 / rank 1):", "",
            "| system | model | params | after build | peak | losses | build s | steps s | launch s |",
            "|---|---|---:|---:|---:|---|---:|---:|---:|"]
    for r in runs:
        if r.get("big"):
            continue
        out.append(_run_row(r))
    out += ["", "Before each launch its memory for both ranks is predicted and the launch skipped above 20 GiB "
            "(theory B/param/rank x params x 1.5 + 1 GiB per rank, DeepSpeed taken at 10 B/param/rank; or the "
            "same system's peak at a smaller size x the params ratio x 1.1 when larger; the big run: the fit)."]
    out += ["", "### (b) Largest GPT within 20 GiB for both ranks, predicted from (a)", "",
            "params_max = (10 GiB - intercept) / slope, per rank.", "",
            "| system | fitted B/param/rank | intercept GiB/rank | predicted largest params |",
            "|---|---:|---:|---:|"]
    for label in s["labels"]:
        line = res["fits"].get(label)
        if line is None:
            out.append(f"| {label} | n/a | n/a | n/a (no fit) |")
            continue
        n = largest_params(line)
        out.append(f"| {label} | {line['slope']:.2f} | {_gib(line['intercept'])} | "
                   f"{'n/a (slope <= 0)' if n is None else f'{n / 1e9:.2f} B'} |")
    out += ["", "### (c) fz3 with fz3.Init: the largest model the fit says fits", ""]
    big = res.get("big")
    if big is None:
        out.append("Not run (--no-big).")
    else:
        out += [big["why"], "",
                "Construction peak: ru_maxrss right after the `with fz3.Init():` block, against issue #11's "
                "bound (1/N of the model in fp32 + its largest module + 300 MB); after initialize: once "
                "fz3.initialize returned (the fp32 grad partitions added).", "",
                "| model | params | predicted GiB (both ranks) | construction peak GiB (r0 / r1) | bound GiB | "
                "after initialize GiB | peak GiB (r0 / r1) | losses | loss falls | build s | steps s | launch s |",
                "|---|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|"]
        r = big.get("run")
        head = f"| {r['model']} | {r['params']:,} | {_gib(r['predicted_bytes'])} |" if r else ""
        if r is not None and r["status"] != "ok":
            out.append(head + f" {r['reason']} |" + " |" * 8)
        elif r is not None:
            bound = construction_target(r["model"])
            out.append(head + f" {_pair(r, 'init_peak_rss')} | {_gib(bound)} | {_pair(r, 'build_peak_rss')} | "
                       f"{_pair(r, 'peak_rss')} | "
                       f"{', '.join(f'{x:.3f}' for x in r['losses'])} | {'yes' if r['falling'] else 'NO'} | "
                       f"{r['build_s']:.0f} | {', '.join(f'{t:.1f}' for t in r['step_s'])} | {r['wall_s']:.0f} |")
    out += ["", f"Raw records: {os.path.relpath(res['out_path'], ROOT)} (not in git).", END]
    return "\n".join(out)


def _run_row(r: dict) -> str:
    head = f"| {r['label']} | {r['model']} | {r['params']:,} |"
    if r["status"] != "ok":
        return head + f" {r['reason']} | | | | | |"
    return (head + f" {_pair(r, 'build_peak_rss')} | {_pair(r, 'peak_rss')} | "
            f"{', '.join(f'{x:.3f}' for x in r['losses'])} | {r['build_s']:.0f} | "
            f"{', '.join(f'{t:.1f}' for t in r['step_s'])} | {r['wall_s']:.0f} |")


def write_md(section: str, path: str) -> None:
    from bench_env import replace_section
    replace_section(path, section, BEGIN, END)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="comma list of: ddp, fsdp2, deepspeed, fz3, fz3-init (default all)")
    ap.add_argument("--sizes", default=None, help=f"comma list of MODELS for the fit (default {','.join(SIZES)})")
    ap.add_argument("--no-big", action="store_true", help="skip part 3 (fz3.Init on the largest model)")
    ap.add_argument("--smoke", action="store_true",
                    help=f"tiny models ({','.join(SMOKE_SIZES)}, big {','.join(SMOKE_LADDER)}); writes RESULTS.md "
                         "only when --md is given")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per launch")
    ap.add_argument("--md", default=None, help="RESULTS file to write the section into (default bench/RESULTS.md, "
                                               "none with --smoke)")
    ap.add_argument("--no-md", action="store_true", help="write no RESULTS file (a partial run)")
    ap.add_argument("--out", default=None, help="raw JSON (default bench/out/memory.json, memory_smoke.json "
                                                "with --smoke)")
    args = ap.parse_args()
    import torch
    torch.set_num_threads(1)
    from compare import machine_info, versions
    from systems.common import MODELS
    t_start = time.time()
    table = systems_table()
    labels = args.only.split(",") if args.only else list(table)
    sizes = args.sizes.split(",") if args.sizes else (SMOKE_SIZES if args.smoke else SIZES)
    ladder = SMOKE_LADDER if args.smoke else LADDER
    for name in labels:
        if name not in table:
            ap.error(f"--only: unknown system {name!r} (known: {', '.join(table)})")
    for name in sizes:
        if name not in MODELS:
            ap.error(f"--sizes: unknown model {name!r} (known: {', '.join(MODELS)})")
    md = None if args.no_md else args.md or (None if args.smoke else os.path.join(BENCH, "RESULTS.md"))
    out_path = args.out or os.path.join(BENCH, "out", "memory_smoke.json" if args.smoke else "memory.json")
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    params = {m: count_params(m) for m in dict.fromkeys(sizes + ladder)}
    sizes.sort(key=params.get)  # smallest first: a larger size's guard extrapolates from it
    res: dict = {"command": "python3 bench/diagnostics/memory.py " + " ".join(sys.argv[1:]), "out_path": out_path,
                 "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%a %b %d %H:%M:%S UTC %Y"),
                 "machine": machine_info(), "versions": versions(), "fz3_has_init": fz3_has_init(),
                 "settings": {"world": WORLD, "steps": STEPS, "threads_per_rank": 1, "env": MMAP_ENV,
                              "labels": labels, "sizes": sizes, "ladder": ladder, "limit_bytes": LIMIT,
                              "guard": {"factor": GUARD_FACTOR, "per_rank_bytes": GUARD_PER_RANK,
                                        "extrapolation_factor": EXTRAP_FACTOR,
                                        "big_factor": BIG_FACTOR, "big_min_slope": BIG_MIN_SLOPE},
                              "zero_optimization": zero_dict(), "fz3_config": table["fz3"]["options"]["config"]},
                 "params": params, "theory": {k: table[k]["theory"] for k in table}, "runs": [], "fits": {}}
    log(f"fz3 {res['versions'].get('fz3_git')}, fz3.Init {'present' if res['fz3_has_init'] else 'absent'}; "
        f"params: " + ", ".join(f"{m} {n:,}" for m, n in params.items()))

    # ---- 1. peak RSS at the fit sizes ----------------------------------------------------------
    for model in sizes:
        for label in labels:
            system = table[label]
            guard = WORLD * int(system["guard"] * params[model] * GUARD_FACTOR + GUARD_PER_RANK)
            smaller = [r for r in res["runs"] if r["label"] == label and r["status"] == "ok"
                       and r["params"] < params[model]]
            if smaller:  # proportional to params from the largest one measured: intercept included
                r = max(smaller, key=lambda r: r["params"])
                guard = max(guard, int(WORLD * max(r["peak_rss"]) * params[model] / r["params"] * EXTRAP_FACTOR))
            res["runs"].append(run_one(label, system, model, params[model], guard, args.timeout))
    for label in labels:
        line = fit([r for r in res["runs"] if r["label"] == label])
        if line is not None:
            res["fits"][label] = line
            n = largest_params(line)
            log(f"{label:9s} fit: {line['slope']:.2f} B/param/rank + {line['intercept'] / GiB:.2f} GiB; "
                f"largest in 20 GiB: {'n/a' if n is None else f'{n / 1e9:.2f} B params'}")

    # ---- 3. fz3.Init on the largest model the fit allows ------------------------------------------
    if not args.no_big:
        basis = next((k for k in ("fz3-init", "fz3") if k in res["fits"]), None)
        big: dict = {"basis": basis}
        if basis is None:
            big["why"] = "Not run: no fz3 fit from (a) to predict it from."
        else:
            line = res["fits"][basis]
            pred = {m: predict_big(line, params[m]) for m in ladder}
            fits_in = [m for m in ladder if pred[m] <= LIMIT]
            big["predicted_bytes"] = pred
            choice = fits_in[-1] if fits_in else ladder[0]
            big["why"] = (f"Ladder {', '.join(f'{m} ({params[m]:,} params: {pred[m] / GiB:.1f} GiB)' for m in ladder)}"
                          f", predicted for both ranks from the {basis} line (slope at least {BIG_MIN_SLOPE:g} "
                          f"B/param) x {BIG_FACTOR}; the largest within 20 GiB: "
                          f"{choice if fits_in else 'none'}.")
            rec = run_one("fz3-init", table["fz3-init"], choice, params[choice], pred[choice], args.timeout)
            rec["big"] = True
            big["run"] = rec
            res["runs"].append(rec)
        res["big"] = big
        log(big["why"])

    res["total_s"] = time.time() - t_start
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1, default=str)
    section = render(res)
    print(section)
    if md:
        write_md(section, md)
    log(f"wrote {out_path}" + (f" and {md}" if md else "") + f" in {res['total_s'] / 60:.1f} min")
    failed = [r for r in res["runs"] if r["status"] == "error"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
