"""Step time and peak memory of fz3, DDP and FSDP2 on one device: the table bench/gpu.sh writes.

    python bench/gpu_steps.py --device cuda [--models deep,small] [--systems fz3,fz3-sharded,...]
                              [--rounds 2] [--warmup 5] [--steps 20] [--out DIR]

World 1 (one GPU cannot host two NCCL ranks): each system is one rank of fz3.launch.run on its
device (FZ3_DEVICE / FZ3_BENCH_DEVICE), so fz3's hooks, gathers (a world-1 NCCL all-gather),
reduces and optimizer on fp32 shards are measured against plain DDP and FSDP2 steps where
compute is cheap. Launches are interleaved (round r runs every system, reversed on odd rounds);
each cell is the median of the launches' median step times. Peak memory: the device's
max_memory_allocated on cuda, ru_maxrss on cpu (a stats launch). `--device cpu` runs the same
code on gloo: what CI checks (tests/test_gpu_script.py), not a figure to report.
`fz3-offload` is fz3 with offload_optimizer and offload_param "cpu", as HF's documented ZeRO-3 JSON:
on the device, the optimizer stepped on the host (the grads copied to pinned host buffers;
fz3/core/offload.py `host`) and the params' shards kept there, each gather copying its shards to
the device; its peak is the device's, without the fp32 masters, the optimizer state and the
shards. On cpu it runs the same path with Options(host_step=True). `fz3-sharded` is fz3 with every
param sharded (param_persistence_threshold 0, as FSDP2 shards them), and `fz3-fused` that with
torch's fused AdamW (every other row steps torch's default, foreach on an accelerator), to which
fz3 leaves the skip of a non-finite step: its step reads nothing of the device ([Note: the
verdict on the device], fz3/core/grad/verdict.py); the `-compiled` rows compile
each transformer block with inductor (bench/systems/*_compiled.py; issue #48 point 5 asks
compiled >= 1.1x eager). Each row also gives the ATen ops one steady step launches and the reads
of device memory that make the host wait, counted by bench/systems/launch_count.py (on cuda every
such read is a real sync; the harness's own loss.item() is one of each row); not for the compiled
rows, whose graphs a dispatch mode makes torch.compile run eagerly. `--trace`: one more launch
of each system of TRACED, its first steady step under torch.profiler (DIR/trace-MODEL-SYSTEM.json,
for Perfetto) and the share of that step's communication kernels that ran while compute kernels
did (bench/systems/overlap.py; on cpu the host's ops stand in, not a figure to report).
Writes DIR/steps.json and DIR/steps.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # systems.* (spawned ranks inherit sys.path)

SYSTEMS = {"fz3": "fz3_z3", "fz3-sharded": "fz3_z3", "fz3-fused": "fz3_z3", "fz3-offload": "fz3_z3", "ddp": "ddp",
           "fsdp2": "fsdp2",
           "fz3-compiled": "fz3_compiled", "ddp-compiled": "ddp_compiled", "fsdp2-compiled": "fsdp2_compiled"}
OPTIONS = {"fz3": {"config": {}},
           "fz3-sharded": {"config": {"param_persistence_threshold": 0}},
           "fz3-fused": {"config": {"param_persistence_threshold": 0}, "fused": True},
           "fz3-offload": {"config": {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"},
                                      "host_step": True}},
           "fz3-compiled": {"config": {}, "compile": "blocks"}}
EAGER = "fz3,fz3-sharded,fz3-fused,fz3-offload,ddp,fsdp2"  # --systems eager: what the CPU half runs (no compiles)
TRACED = ("fz3-sharded", "fz3-fused", "fsdp2")  # --trace: a profiled step of each (issue #48 point 5)


def launch(system: str, spec: dict) -> list[dict]:
    from compare import launch as launch_system  # bench/compare.py's launch, at world 1
    return launch_system({"module": SYSTEMS[system], "world": 1}, spec, timeout=600)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), required=True)
    ap.add_argument("--models", default="deep,small")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list, or 'eager' ({EAGER})")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=os.path.join(HERE, "out", "gpu"))
    ap.add_argument("--trace", action="store_true",
                    help=f"one more launch of each of {', '.join(TRACED)} per model: a torch.profiler trace of one "
                         "steady step (DIR/trace-MODEL-SYSTEM.json) and the share of its communication hidden "
                         "behind compute")
    args = ap.parse_args(argv)
    systems = (EAGER if args.systems == "eager" else args.systems).split(",")
    bad = [s for s in systems if s not in SYSTEMS]
    if bad:
        ap.error(f"--systems: {bad} not among {sorted(SYSTEMS)}")
    os.environ["FZ3_DEVICE"] = os.environ["FZ3_BENCH_DEVICE"] = args.device
    from systems.common import MODELS
    models = args.models.split(",")
    bad = [m for m in models if m not in MODELS]
    if bad:
        ap.error(f"--models: {bad} not among {sorted(MODELS)}")
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for model in models:
        medians: dict[str, list[float]] = {s: [] for s in systems}
        losses: dict[str, float] = {}
        for r in range(args.rounds):
            for system in (systems if r % 2 == 0 else systems[::-1]):
                out = launch(system, {"model": model, "warmup": args.warmup, "steps": args.steps, "mode": "time",
                                      "options": OPTIONS.get(system, {})})[0]
                medians[system].append(statistics.median(out["times"]) * 1e3)
                losses[system] = out["losses"][-1]
        for system in systems:
            # the ops of its first steady step counted too (the peak is the whole launch's); a
            # dispatch mode makes torch.compile run its graphs eagerly: no count of the compiled rows
            compiled = system.endswith("-compiled")
            stats = launch(system, {"model": model, "warmup": 2, "steps": 3, "mode": "stats",
                                    "count_launches": not compiled, "options": OPTIONS.get(system, {})})[0]
            peak = stats.get("peak_device_bytes", stats.get("peak_rss", 0))
            counted = stats["launches"] if not compiled else {"launches": None, "sync_total": None, "syncs": {}}
            overlap = None
            if args.trace and system in TRACED:
                path = os.path.join(args.out, f"trace-{model}-{system}.json")
                overlap = launch(system, {"model": model, "warmup": 3, "steps": 1, "mode": "time", "trace": path,
                                          "options": OPTIONS.get(system, {})})[0]["overlap"]
            rows.append({"model": model, "system": system, "device": args.device, "overlap": overlap,
                         "launches": counted["launches"], "syncs": counted["sync_total"],
                         "sync_ops": counted["syncs"],
                         "median_ms": statistics.median(medians[system]), "launch_medians_ms": medians[system],
                         "peak_mib": peak / 2**20, "peak_kind": "device" if "peak_device_bytes" in stats else "rss",
                         "last_loss": losses[system]})
    with open(os.path.join(args.out, "steps.json"), "w") as f:
        json.dump(rows, f, indent=1)
    lines = ["| model | system | median step ms | launch medians | ÷ DDP | ÷ FSDP2 | peak MiB | launches | syncs "
             "| comm hidden | last loss |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        def ratio(to: str) -> str:
            base = next((x["median_ms"] for x in rows if x["model"] == row["model"] and x["system"] == to), None)
            return f"{row['median_ms'] / base:.2f}" if base else "–"
        lines.append(f"| {row['model']} | {row['system']} | {row['median_ms']:.1f} | "
                     f"{' / '.join(f'{t:.1f}' for t in row['launch_medians_ms'])} | {ratio('ddp')} | "
                     f"{ratio('fsdp2')} | {row['peak_mib']:.0f} ({row['peak_kind']}) | {row['launches'] or '–'} | "
                     f"{'–' if row['syncs'] is None else row['syncs']} | {_hidden(row['overlap'])} | "
                     f"{row['last_loss']:.6f} |")
    with open(os.path.join(args.out, "steps.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def _hidden(overlap: dict | None) -> str:
    """'62 % of 1.3 ms' (the share of the traced step's communication run beside compute)."""
    if not overlap or overlap["hidden_fraction"] is None:
        return "–"
    return f"{overlap['hidden_fraction'] * 100:.0f} % of {overlap['comm_us'] / 1e3:.2f} ms"


if __name__ == "__main__":
    sys.exit(main())
