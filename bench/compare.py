"""fz3 against single-process, DDP, FSDP2 and DeepSpeed ZeRO-3 on 2 local gloo ranks (issue #5).

    python3 bench/compare.py                 # sets up bench/.env if missing, runs everything,
                                             # writes bench/RESULTS.md (its section) + bench/results.json
    python3 bench/compare.py --rounds 1 --steps 3 --models small   # a quick look

Every system trains the same GPT from the same seed on the same data with torch AdamW, fp32,
2 ranks x 1 intra-op thread (single process: 1 rank, the whole batch). Timed launches are
interleaved (round r runs every system once, in reverse order on odd rounds) so that load
drift hits all alike; warm-up steps are discarded. Memory, collectives and peak RSS come from
separate "stats" launches run with MALLOC_MMAP_THRESHOLD_=131072 (docs/environment.md). Then: the
ZeRO-3 volume check, the fz3 per-step breakdown (bench/breakdown.py), the core-overhead
table (bench/core_overhead.py) and the cost of fz3's pack/unpack copies (bench/copy_costs.py).
The log goes to stdout; bench/out/ (ignored by git) holds scratch files.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
NATIVE = {"gloo_all_gather": "native", "gloo_reduce_scatter": "native"}


if __name__ == "__main__":
    from bench_env import ensure_env
    ensure_env(__file__)

sys.path.insert(0, HERE)  # systems.*, breakdown (spawned ranks inherit sys.path)

def systems_table(with_volume: bool) -> dict[str, dict]:
    """label -> {module, world, options}. fz3-ds = Config.from_deepspeed(DeepSpeed's dict);
    fz3-native = fz3 with gloo's own collectives (NATIVE)."""
    from fz3 import Config
    from systems.deepspeed_z3 import ds_config
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        same = Config.from_deepspeed(ds_config("small", 2))
    table = {
        "single": {"module": "single", "world": 1, "options": {}},
        "ddp": {"module": "ddp", "world": 2, "options": {}},
        "fsdp2": {"module": "fsdp2", "world": 2, "options": {}},
        "deepspeed": {"module": "deepspeed_z3", "world": 2, "options": {}},
        "fz3": {"module": "fz3_z3", "world": 2, "options": {"config": {}}},
        "fz3-native": {"module": "fz3_z3", "world": 2, "options": {"config": NATIVE}},
    }
    same_fields = dataclasses.asdict(same)
    if same != Config():
        table["fz3-ds"] = {"module": "fz3_z3", "world": 2, "options": {"config": same_fields}}
    if with_volume:
        vol = {"max_reuse_distance": 0, "param_persistence_threshold": 0, **NATIVE}
        table["fz3-vol"] = {"module": "fz3_z3", "world": 2, "options": {"config": vol}}
    return table, same == Config(), same_fields


def launch(system: dict, spec: dict, timeout: float, env: dict | None = None) -> list[dict]:
    """One launch of `system`'s ranks, with its own environment ("env": see `fz3_variant`) and `env`."""
    import fz3.launch
    from systems.common import worker
    with fz3.launch.spawn_environment({**system.get("env", {}), **(env or {})}):
        return fz3.launch.run(worker, world_size=system["world"], args=(system["module"], spec),
                              timeout=timeout, threads=1)


def fz3_variant(fields: dict) -> dict:
    """An fz3 system with these Config / Options fields; "malloc_thresholds": true starts its ranks
    with glibc's heap thresholds, as fz3.launch.run(malloc_thresholds=True) does (fz3/data/heap.py)."""
    from fz3.data import heap
    fields = dict(fields)
    env = heap.rank_environment() if fields.pop("malloc_thresholds", False) else {}
    return {"module": "fz3_z3", "world": 2, "options": {"config": fields}, **({"env": env} if env else {})}


def merge_ranks(results: list[dict]) -> dict:
    """Per step: the slowest rank's time; the mean of the ranks' losses (equal local batches)."""
    times = [max(r["times"][i] for r in results) for i in range(len(results[0]["times"]))]
    losses = [statistics.fmean(r["losses"][i] for r in results) for i in range(len(results[0]["losses"]))]
    cpu = [statistics.fmean(r["cpu"][i] for r in results) for i in range(len(results[0]["cpu"]))]
    return {"times": times, "cpu": cpu, "losses": losses, "build_s": max(r["build_s"] for r in results)}


def theory(model_name: str, world: int) -> dict:
    """Analytic ZeRO-3 bytes per step per rank with reuse distance 0 and persistence 0. Every
    fetch unit (module, its own params) is gathered in forward and again in backward, except the
    embeddings: they take token ids (no grad-requiring input) and their backward reads no param,
    so fz3 gathers them in forward only ([Note: backward reads no param], fz3/shell/engine.py;
    DeepSpeed and FSDP2 gather them again)."""
    from torch import nn
    from systems.common import make_model
    model = make_model(model_name)
    pad = lambda n: -(-n // world) * world  # noqa: E731
    distinct = {id(p): p for p in model.parameters()}
    param_sum = sum(pad(p.numel()) for p in distinct.values())
    seen, unit_sum, backward_sum = set(), 0, 0
    for m in model.modules():
        if id(m) in seen:
            continue
        seen.add(id(m))
        own = sum(pad(p.numel()) for p in m.parameters(recurse=False))
        unit_sum += own
        backward_sum += 0 if isinstance(m, nn.Embedding) else own
    f = (world - 1) / world
    gathered = (unit_sum + backward_sum) * 4
    return {"padded_param_numel": param_sum, "padded_unit_numel": unit_sum,
            "padded_backward_unit_numel": backward_sum,
            "gather_buffer_bytes": gathered, "reduce_buffer_bytes": param_sum * 4,
            "gather_wire_bytes": gathered * f, "reduce_wire_bytes": param_sum * 4 * f,
            "gather_wire_bytes_untied": 2 * param_sum * 4 * f,
            "numel": sum(p.numel() for p in distinct.values())}


def versions() -> dict:
    import importlib.metadata as md
    import torch
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for pkg in ("deepspeed",):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    try:
        out["fz3_git"] = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "fz3"], capture_output=True,
                               text=True).stdout.strip()
        out["fz3_dirty"] = bool(dirty)
    except OSError:
        pass
    return out


def machine_info() -> dict:
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(),
            "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "platform": platform.platform()}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.2f}] {msg}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="small,wide")
    ap.add_argument("--systems", default=None, help="comma list of labels (default: all)")
    ap.add_argument("--interleave", choices=("steps", "launches"), default="steps",
                    help="steps: persistent ranks per system, one step each in turn (default); "
                         "launches: a fresh launch per system per round")
    ap.add_argument("--rounds", type=int, default=3, help="launches mode: rounds")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=None,
                    help="measured steps per system and model (steps mode, default 24) or per launch "
                         "(launches mode, default 8)")
    ap.add_argument("--stats-steps", type=int, default=3)
    ap.add_argument("--breakdown-steps", type=int, default=6)
    ap.add_argument("--no-volume-timed", action="store_true",
                    help="do not time fz3-vol (it still gets a stats launch, for the volume check)")
    ap.add_argument("--skip", default="", help="comma list of: stats, breakdown, core, copies")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL=JSON",
                    help="one more fz3 system: LABEL, fz3 with these Config / Options fields "
                         "(e.g. fz3-fast='{\"shared_memory\": true, \"malloc_thresholds\": true}'); add it to --systems")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out", default=os.path.join(HERE, "results.json"))
    ap.add_argument("--md", default=os.path.join(HERE, "RESULTS.md"))
    args = ap.parse_args()
    import torch
    torch.set_num_threads(1)
    if args.steps is None:
        args.steps = 24 if args.interleave == "steps" else 8
    if args.interleave == "steps":
        args.rounds = 1
    t_start = time.time()
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    models = args.models.split(",")
    skip = set(filter(None, args.skip.split(",")))
    table, ds_equals_default, ds_fields = systems_table(True)
    for variant in args.variant:
        label, sep, fields = variant.partition("=")
        if not sep or not label or label in table:
            raise SystemExit(f"--variant {variant!r}: want LABEL=JSON with a new label (taken: {sorted(table)})")
        table[label] = fz3_variant(json.loads(fields))
    labels = args.systems.split(",") if args.systems else [k for k in table if k != "fz3-vol" or not args.no_volume_timed]
    stats_labels = labels + (["fz3-vol"] if "fz3-vol" not in labels and "fz3" in labels else [])
    os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
    res: dict = {"started": started, "command": "python3 bench/compare.py " + " ".join(sys.argv[1:]),
                 "machine": machine_info(), "versions": versions(), "load_start": os.getloadavg(),
                 "settings": {"interleave": args.interleave, "rounds": args.rounds, "warmup": args.warmup,
                              "steps": args.steps,
                              "stats_steps": args.stats_steps, "world": 2, "threads_per_rank": 1},
                 "fz3_ds_equals_default": ds_equals_default, "fz3_ds_config": ds_fields,
                 "systems": {k: table[k] for k in stats_labels}, "timed": {}, "stats": {}, "loads": []}
    from systems.deepspeed_z3 import DS_ZERO
    res["deepspeed_zero"] = DS_ZERO

    # ---- timed, interleaved ----------------------------------------------------------------
    if args.interleave == "steps":
        from stepper import run_interleaved
        for model in models:
            out = run_interleaved(table, labels, model, args.warmup, args.steps, log=log)
            for label, run in out.items():
                res["timed"].setdefault(model, {})[label] = [run]
                res["loads"].append(run["load"])
            log(f"{model}: medians " + ", ".join(f"{k} {1e3 * statistics.median(v['times']):.0f} ms"
                                                 for k, v in out.items()))
    for r in range(args.rounds if args.interleave == "launches" else 0):
        order = labels if r % 2 == 0 else labels[::-1]
        for model in models:
            for label in order:
                spec = {"model": model, "warmup": args.warmup, "steps": args.steps, "mode": "time",
                        "options": table[label]["options"]}
                t0 = time.time()
                out = launch(table[label], spec, args.timeout)
                merged = merge_ranks(out)
                merged["launch_s"] = time.time() - t0
                merged["load"] = os.getloadavg()[0]
                res["timed"].setdefault(model, {}).setdefault(label, []).append(merged)
                res["loads"].append(merged["load"])
                log(f"round {r} {model:5s} {label:9s} median {1e3 * statistics.median(merged['times']):7.1f} ms "
                    f"(launch {merged['launch_s']:.0f} s)")

    # ---- stats: memory, collectives, peak RSS -----------------------------------------------
    if "stats" not in skip:
        for model in models:
            for label in stats_labels:
                spec = {"model": model, "warmup": 2, "steps": args.stats_steps, "mode": "stats",
                        "options": table[label]["options"]}
                out = launch(table[label], spec, args.timeout, env={"MALLOC_MMAP_THRESHOLD_": "131072"})
                res["stats"].setdefault(model, {})[label] = out
                log(f"stats {model:5s} {label:9s} mem {out[0]['mem']} peak RSS {[o['peak_rss'] >> 20 for o in out]} MiB")

    # ---- the ZeRO-3 volume check --------------------------------------------------------------
    res["theory"] = {}
    for model in models:
        th = theory(model, 2)
        st = res["stats"].get(model, {}).get("fz3-vol")
        if st:
            ps = st[0]["extra"]["per_step"]
            th["fz3_gathered_bytes"], th["fz3_reduced_bytes"] = ps["gathered_bytes"], ps["reduced_bytes"]
            th["fz3_all_gather_calls"], th["fz3_reduce_calls"] = ps["all_gather"], ps["reduce"]
            comm = st[0]["comm"]
            th["counted_gather_bytes"] = comm.get("all_gather", {}).get("bytes")
            th["counted_reduce_bytes"] = comm.get("reduce_scatter", {}).get("bytes")
            th["gather_ok"] = ps["gathered_bytes"] == th["gather_buffer_bytes"]
            th["reduce_ok"] = ps["reduced_bytes"] == th["reduce_buffer_bytes"]
        res["theory"][model] = th

    # ---- fz3 breakdown ----------------------------------------------------------------------
    res["breakdown"] = {}
    if "breakdown" not in skip:
        import breakdown
        import fz3.launch
        for model in models:
            for label in ("fz3",):
                cfg = table[label]["options"]["config"]
                out = fz3.launch.run(breakdown.worker, world_size=2, args=(model, cfg, 2, args.breakdown_steps),
                                     timeout=args.timeout, threads=1)
                res["breakdown"].setdefault(model, {})[label] = out
                log(f"breakdown {model} {label}: " + ", ".join(
                    f"{k} {1e3 * v:.1f}" for k, v in sorted(out[0]['per_step'].items(), key=lambda kv: -kv[1])))

    # ---- core overhead (issue #2) -------------------------------------------------------------
    if "core" not in skip:
        path = os.path.join(HERE, "out", "core_overhead.json")
        cmd = [sys.executable, os.path.join(HERE, "core_overhead.py"), "--json", path]
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        res["core_overhead"] = {"stdout": proc.stdout, "rows": json.load(open(path)) if proc.returncode == 0 else None,
                                "command": "python bench/core_overhead.py", "seconds": time.time() - t0,
                                "load": os.getloadavg()[0]}
        log("core overhead:\n" + proc.stdout + proc.stderr[-2000:])

    # ---- fz3 data-plane copy costs (diagnosis of the breakdown's pack/unpack rows) ---------------
    if "copies" not in skip:
        res["copy_costs"] = {}
        for model in models:
            cmd = [sys.executable, os.path.join(HERE, "copy_costs.py"), "--model", model]
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            res["copy_costs"][model] = {"stdout": proc.stdout, "load": os.getloadavg()[0],
                                        "command": f"python bench/copy_costs.py --model {model}"}
            log(proc.stdout + proc.stderr[-1000:])

    res.update(load_end=os.getloadavg(), total_s=time.time() - t_start,
               finished=datetime.datetime.now().astimezone().isoformat(timespec="seconds"))
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1, default=str)
    import report
    report.write(res, args.md)
    log(f"wrote {args.out} and {args.md} in {res['total_s'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
