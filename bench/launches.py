"""Issue #48's launch and sync table: the ATen ops one steady step runs (views and metadata
excluded, and c10d's collectives) and the ops that make the host wait for the device, counted
on rank 0 of 2 gloo ranks, for fz3 (default, and every param sharded), DDP, FSDP2 and DeepSpeed
ZeRO-3, each stepping torch's foreach AdamW (its default on an accelerator), on the small and
deep GPTs; and fz3 with fused AdamW, which takes the skip of a non-finite step as a tensor.

    python3 bench/launches.py [--models small,deep] [--systems ...]   # sets up bench/.env if missing;
                                                       # writes its section of bench/RESULTS.md and
                                                       # bench/out/launches.json

How the ops are counted: bench/systems/launch_count.py. A CPU run sees every op an accelerator
would launch and every `.item()` / `torch.equal`, not a CPU tensor's `.tolist()` (no ATen op);
each system's step ends with the harness's `loss.item()`, one sync of every row.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
if __name__ == "__main__":
    from bench_env import ensure_env
    ensure_env(__file__)

SYSTEMS = {  # torch's foreach AdamW, its default on an accelerator, but where "fused"
    "fz3": {"module": "fz3_z3", "world": 2, "options": {"config": {}, "foreach": True}},
    "fz3 all sharded": {"module": "fz3_z3", "world": 2,
                        "options": {"config": {"param_persistence_threshold": 0}, "foreach": True}},
    # fz3 with fused AdamW, which takes the skip of a non-finite step as a tensor: no sync
    # ([Note: the verdict on the device], fz3/core/grad/verdict.py)
    "fz3 fused": {"module": "fz3_z3", "world": 2, "options": {"config": {}, "fused": True}},
    "fz3 all sharded fused": {"module": "fz3_z3", "world": 2,
                              "options": {"config": {"param_persistence_threshold": 0}, "fused": True}},
    # the carriers an accelerator runs (NCCL's own collectives): one copy-in and one copy-out a
    # gather, one copy-in a reduce (torch.cat / split_with_sizes_copy / _chunk_cat)
    "fz3 native fused": {"module": "fz3_z3", "world": 2,
                         "options": {"config": {"param_persistence_threshold": 0, "gloo_all_gather": "native",
                                                "gloo_reduce_scatter": "native"}, "fused": True}},
    "ddp": {"module": "ddp", "world": 2, "options": {"foreach": True}},
    "fsdp2": {"module": "fsdp2", "world": 2, "options": {"foreach": True}},
    "deepspeed": {"module": "deepspeed_z3", "world": 2, "options": {"foreach": True}},
}
BEGIN, END = "<!-- launches:begin -->", "<!-- launches:end -->"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="small,deep")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(HERE, "out", "launches.json"))
    ap.add_argument("--no-results", action="store_true", help="do not write bench/RESULTS.md")
    args = ap.parse_args(argv)
    systems = args.systems.split(",")
    bad = [s for s in systems if s not in SYSTEMS]
    if bad:
        ap.error(f"--systems: {bad} not among {sorted(SYSTEMS)}")
    from compare import launch, machine_info, versions
    rows = []
    for model in args.models.split(","):
        for label in systems:
            system = SYSTEMS[label]
            spec = {"model": model, "warmup": args.warmup, "steps": 1, "mode": "launches",
                    "options": system["options"]}
            got = launch(system, spec, timeout=900)[0]["launches"]
            rows.append({"model": model, "system": label, **got})
            print(f"{model} {label}: {got['launches']} launches, syncs {got['syncs']}", flush=True)
    res = {"command": "python3 bench/launches.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "machine": machine_info(), "versions": versions(), "rows": rows}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    section = render(res)
    print(section)
    if not args.no_results:
        from bench_env import replace_section
        replace_section(os.path.join(HERE, "RESULTS.md"), section, BEGIN, END)
    return 0


def render(res: dict) -> str:
    v = res["versions"]
    lines = [BEGIN, "## Launches and syncs of one steady step (issue #48)", "",
             f"`{res['command']}`, {res['date_utc']}, fz3 {v.get('fz3_git')}"
             f"{' (fz3/ modified)' if v.get('fz3_dirty') else ''}, torch {v['torch']}, "
             f"{res['machine']['cores']} cores.", "",
             "Rank 0 of 2 gloo ranks, the first step after 3 warm-up steps, under a dispatch mode "
             "(bench/systems/launch_count.py): launches = ATen ops less views and metadata; syncs = "
             "`_local_scalar_dense` (`.item()`), `equal`, `is_nonzero` (the harness's `loss.item()` is one "
             "of each row; a CPU tensor's `.tolist()` is not seen); collectives are left out (bench/compare.py "
             "counts them); peer reads = fz3's divergence check reading its peers' descriptors (host tensors, "
             "over a gloo side group on NCCL and HCCL: a wait for the peers, not the device). Every system steps torch's foreach AdamW, as on an accelerator, but the \"fused\" "
             "rows (fused AdamW, to which fz3 leaves the skip of a non-finite step: no read of the grad norm).", "",
             "| model | system | launches | ÷ FSDP2 | syncs | sync ops | peer reads | most launched |",
             "|---|---|---:|---:|---:|---|---:|---|"]
    for r in res["rows"]:
        fsdp = next((x["launches"] for x in res["rows"] if x["model"] == r["model"] and x["system"] == "fsdp2"), None)
        ratio = f"{r['launches'] / fsdp:.2f}" if fsdp else "–"
        ops = ", ".join(f"{k.split('::')[1]} {n}" for k, n in sorted(r["syncs"].items()))
        top = ", ".join(f"{k.split('::')[1]} {n}" for k, n in r["top"][:5])
        lines.append(f"| {r['model']} | {r['system']} | {r['launches']} | {ratio} | {r['sync_total']} | {ops} | "
                     f"{r.get('peer_reads', 0)} | {top} |")
    lines += ["", "Raw records: bench/out/launches.json (not in git).", END]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
