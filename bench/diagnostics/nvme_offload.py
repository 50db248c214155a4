"""Issue #47's measurement: the optimizer on NVMe (offload_optimizer.device "nvme"), on 2 gloo ranks.

    python3 bench/diagnostics/nvme_offload.py [--nvme-path DIR]   # sets up bench/.env if missing;
                                                       # writes its section of bench/RESULTS.md and
                                                       # bench/out/nvme_offload.json
    python3 bench/diagnostics/nvme_offload.py --smoke  # the same pipeline on tiny models
    python3 bench/diagnostics/nvme_offload.py --rerun "optimizer and params on NVMe"   # one b1 row
                                                       # again, the other rows kept from the last JSON

1. The 1.02 B GPT (b1), fz3.Init, fp32, 3 steps: fz3.Config() (everything in memory) against the
   same Config with the fp32 masters and AdamW's moments on disk (sub_group_size SUB_GROUP):
   step time, peak RSS per rank, the bytes each step read and wrote and the seconds it waited
   on the disk (engine.stats()), and fz3.plan's model states at the peak beside each measured
   peak.
   And with the params on NVMe too (offload_param "nvme": the shards are the masters, on disk;
   every gather reads them from there).
2. The largest GPT of a ladder that the plan (optimizer and params on NVMe) predicts within the
   memory available, calibrated by step 1's run of the same kind (its peak RSS above its plan is
   what the plan does not count), trained 3 steps.

The runs' numbers are checked by the property that the step with offload equals the step without,
bit for bit (tests/test_offload.py, on every CI run): the b1 runs' losses here must be equal too.
The disk tier writes with fdatasync and drops its page cache (fz3/data/swap.py), so the bytes on
disk are not quietly in RAM.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)
sys.path[:0] = [HERE, BENCH]
if __name__ == "__main__":
    from bench_env import ensure_env
    ensure_env(__file__)

GiB = 2**30
STEPS = 3
SUB_GROUP = 100_000_000  # elements: 1.2 GB of masters and moments in memory at once, at most
BASE, LADDER = "b1", ("b4", "b35", "b3", "b25")  # largest first
BUCKETS = {"reduce_bucket_size": 50_000_000}  # DeepSpeed's 5e8 would hold 2 GB of fp32 bucket a rank
SMOKE_BASE, SMOKE_LADDER = "s2", ("s3",)
BEGIN, END = "<!-- nvme_offload:begin -->", "<!-- nvme_offload:end -->"
LABELS = ("in memory", "optimizer on NVMe", "optimizer on NVMe, pipeline_read and pipeline_write",
          "optimizer and params on NVMe")


def offload_config(nvme: str, params: bool = False, pipelined: bool = False) -> dict:
    out = {**BUCKETS, "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "pipeline_read": pipelined,
                                            "pipeline_write": pipelined}, "sub_group_size": SUB_GROUP}
    if params:
        out["offload_param"] = {"device": "nvme", "nvme_path": nvme}
    return out


def worker(rank: int, world: int, spec: dict) -> dict:
    """One rank: the model under fz3.Init, fz3.initialize with spec's config, STEPS steps on one
    batch; per step its seconds, loss and the disk's counts."""
    import torch

    import fz3
    from systems.common import batches, fz3_settings, loss_fn, make_model, make_optimizer, peak_rss_bytes
    t0 = time.perf_counter()
    with fz3.Init():
        model = make_model(spec["model"])
    config, options = fz3_settings(spec["config"])
    engine = fz3.initialize(model, make_optimizer(model.parameters()), config, options=options)
    out = {"rank": rank, "build_s": time.perf_counter() - t0, "build_peak_rss": peak_rss_bytes(), "steps": []}
    x, y = batches(spec["model"], rank, world, 1)[0]
    for _ in range(STEPS):
        t = time.perf_counter()
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
        s = engine.stats()
        out["steps"].append({"s": time.perf_counter() - t, "loss": loss.item(),
                             **{k: s[k] for k in s if "disk" in k or "param_read" in k}})
    out["peak_rss"] = peak_rss_bytes()
    if getattr(engine, "offload", None) is not None:
        engine.offload.close()
    torch.distributed.barrier()
    return out


def run(model: str, config: dict, timeout: float) -> dict:
    import fz3.launch
    from memory import MMAP_ENV
    saved = {k: os.environ.get(k) for k in MMAP_ENV}
    os.environ.update(MMAP_ENV)
    t0 = time.time()
    try:
        ranks = fz3.launch.run(worker, world_size=2, args=({"model": model, "config": config},), timeout=timeout,
                               threads=1)
    except Exception as e:  # noqa: BLE001 - record it
        return {"status": "error", "reason": str(e).strip().splitlines()[-1][:300], "wall_s": time.time() - t0}
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    return {"status": "ok", "wall_s": time.time() - t0, "ranks": ranks,
            "peak_rss": [r["peak_rss"] for r in ranks],
            "losses": [sum(r["steps"][i]["loss"] for r in ranks) / 2 for i in range(STEPS)],
            "step_s": [max(r["steps"][i]["s"] for r in ranks) for i in range(STEPS)]}


def planned(model: str, config: dict) -> int:
    """fz3.plan's model states at the peak, per rank, on 2 ranks (the model built on meta)."""
    import torch

    import fz3
    from systems.common import MODELS, batches, fz3_settings  # puts examples/ (gpt) on the path
    from gpt import GPT
    with torch.device("meta"):
        m = GPT(MODELS[model][0])
    cfg, own = fz3_settings(config)
    p = fz3.plan(m, cfg, world_size=2, example_inputs=(batches(model, 0, 2, 1)[0][0],), steps=2, optimizer="adamw",
                 backend="gloo", options=own)
    return max(s["model_state_peak_bytes"] for s in p.steps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nvme-path", default=os.path.join(BENCH, "out", "nvme"), help="the folder on the drive")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--ladder-only", action="store_true", help="keep the b1 runs of the last JSON, run the ladder "
                    "again")
    ap.add_argument("--rerun", action="append", default=[], choices=LABELS,
                    help="run this b1 row again (repeatable), keeping every other row of the last JSON")
    args = ap.parse_args()
    import memory
    from compare import machine_info, versions
    base, ladder = (SMOKE_BASE, SMOKE_LADDER) if args.smoke else (BASE, LADDER)
    os.makedirs(args.nvme_path, exist_ok=True)
    out_path = os.path.join(BENCH, "out", "nvme_offload_smoke.json" if args.smoke else "nvme_offload.json")
    t0 = time.time()
    res: dict = {"command": "python3 bench/diagnostics/nvme_offload.py " + " ".join(sys.argv[1:]),
                 "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                 "machine": machine_info(), "versions": versions(), "nvme_path": args.nvme_path,
                 "disk_free_gib": shutil.disk_usage(args.nvme_path).free / GiB, "runs": {}}
    off, both = offload_config(args.nvme_path), offload_config(args.nvme_path, params=True)
    piped = offload_config(args.nvme_path, pipelined=True)
    if args.ladder_only or args.rerun:
        with open(out_path) as f:
            last = json.load(f)
        res["runs"] = {k: v for k, v in last["runs"].items() if k.startswith(f"{base}, ") or args.rerun}
        res["kept_from"] = {"date_utc": last["date_utc"], "rows": [k for k in res["runs"] if k.split(", ", 1)[1]
                                                                    not in args.rerun]}
        for k in res["runs"]:
            res["runs"][k].setdefault("date_utc", last["date_utc"])
        if args.rerun:
            res["skipped"] = last.get("skipped", [])
    configs = dict(zip(LABELS, (BUCKETS, off, piped, both)))
    for label, config in ((k, configs[k]) for k in (args.rerun if args.rerun else () if args.ladder_only else LABELS)):
        rec = {"model": base, "params": memory.count_params(base), "plan": planned(base, config),
               "date_utc": res["date_utc"]}
        memory.log(f"{base} {label}: plan {rec['plan'] / GiB:.2f} GiB a rank ...")
        rec.update(run(base, config, args.timeout))
        memory.log(f"  -> {rec.get('peak_rss')} {rec.get('step_s')} {rec.get('reason', '')}")
        res["runs"][f"{base}, {label}"] = rec
    cal = res["runs"][f"{base}, optimizer and params on NVMe"]
    if cal["status"] == "ok" and not args.rerun:
        excess = max(cal["peak_rss"]) - cal["plan"]
        avail = memory.available_bytes() - GiB
        for model in ladder:
            plan = planned(model, both)
            predicted = 2 * (plan + excess)
            memory.log(f"{model}: plan {plan / GiB:.2f} GiB a rank, predicted {predicted / GiB:.2f} GiB for both "
                       f"ranks, {avail / GiB:.2f} available")
            if predicted <= avail:
                rec = {"model": model, "params": memory.count_params(model), "plan": plan, "predicted": predicted,
                       "date_utc": res["date_utc"]}
                rec.update(run(model, both, args.timeout))
                memory.log(f"  -> {rec.get('peak_rss')} {rec.get('step_s')} {rec.get('reason', '')}")
                res["runs"][f"{model}, optimizer and params on NVMe (largest)"] = rec
                break
            res.setdefault("skipped", []).append({"model": model, "plan": plan, "predicted": predicted})
    res["total_s"] = time.time() - t0
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1, default=str)
    section = render(res, out_path)
    print(section)
    if not args.smoke:
        from bench_env import replace_section
        replace_section(os.path.join(BENCH, "RESULTS.md"), section, BEGIN, END)
    return 0 if all(r["status"] == "ok" for r in res["runs"].values()) else 1


def render(res: dict, out_path: str) -> str:
    g = lambda b: f"{b / GiB:.2f}"  # noqa: E731
    v = res["versions"]
    lines = [BEGIN, "## The optimizer on NVMe (issue #47)", "",
             f"`{res['command']}`, {res['date_utc']}, fz3 {v.get('fz3_git')}"
             f"{' (fz3/ modified)' if v.get('fz3_dirty') else ''}, torch {v['torch']}, {res['machine']['cores']} "
             f"cores, {res['machine']['mem_gib']} GiB, disk {res['disk_free_gib']:.0f} GiB free; "
             f"{res['total_s'] / 60:.0f} min" + (f" (the rows dated {res['kept_from']['date_utc']} kept from that run)"
                                                  if res.get("kept_from") else "") + ".", "",
             f"2 gloo ranks x 1 thread, fz3.Init, fp32, torch AdamW, seq 64, 1 sequence per rank, {STEPS} steps on "
             f"one batch, reduce_bucket_size {BUCKETS['reduce_bucket_size']:,}, DeepSpeed's other defaults. Offload: offload_optimizer {{device: nvme}}, sub_group_size {SUB_GROUP:,} (the fp32 "
             "masters and both AdamW moments of every sub-group on disk between steps, each read, stepped and "
             "written back in turn; writes fdatasync'd, page cache dropped). Plan = fz3.plan's model states at the "
             "peak per rank. Disk = the last step's bytes read / written per rank and seconds waited on it; with "
             "params on NVMe, how many of the step's gathers found their shard read ahead / waited for it.", "",
             "| model | params | offload | run | plan GiB/rank | peak RSS GiB (r0 / r1) | above plan | step s | "
             "disk read / written GB, wait s (last step, r0) | losses |",
             "|---|---:|---|---|---:|---:|---:|---|---|---|"]
    for label, r in res["runs"].items():
        head = (f"| {r['model']} | {r['params']:,} | {label.split(', ', 1)[1]} | {r.get('date_utc', res['date_utc'])} "
                f"| {g(r['plan'])} |")
        if r["status"] != "ok":
            lines.append(head + f" {r['reason']} | | | | |")
            continue
        last = r["ranks"][0]["steps"][-1]
        disk = (f"{last['step_disk_bytes_read'] / 1e9:.2f} / {last['step_disk_bytes_written'] / 1e9:.2f}, "
                f"{last['step_disk_wait_seconds']:.1f}" if "step_disk_bytes_read" in last else "-")
        if "step_param_reads_ahead" in last:
            disk += (f"; gathers' reads ahead / waited {last['step_param_reads_ahead']} / "
                     f"{last['step_param_reads_waited']}, waited on {last['step_param_read_wait_seconds']:.1f} s")
        lines.append(head + f" {' / '.join(g(b) for b in r['peak_rss'])} | {g(max(r['peak_rss']) - r['plan'])} | "
                     f"{', '.join(f'{t:.1f}' for t in r['step_s'])} | {disk} | "
                     f"{', '.join(f'{x:.4f}' for x in r['losses'])} |")
    for s in res.get("skipped", []):
        lines.append(f"| {s['model']} | | optimizer and params on NVMe | | {g(s['plan'])} | not run: predicted "
                     f"{g(s['predicted'])} GiB for both ranks | | | | |")
    lines += ["", f"Raw records: {os.path.relpath(out_path, os.path.dirname(BENCH))} (not in git).", END]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
