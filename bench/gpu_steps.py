"""Step time and peak memory of fz3, DDP and FSDP2 on one device: the table bench/gpu.sh writes.

    python bench/gpu_steps.py --device cuda [--models deep,small] [--systems fz3,fz3-offload,ddp,fsdp2]
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
shards. On cpu it runs the same path with Options(host_step=True).
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

SYSTEMS = {"fz3": "fz3_z3", "fz3-offload": "fz3_z3", "ddp": "ddp", "fsdp2": "fsdp2"}
OPTIONS = {"fz3": {"config": {}},
           "fz3-offload": {"config": {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"},
                                      "host_step": True}}}


def launch(system: str, spec: dict) -> list[dict]:
    from compare import launch as launch_system  # bench/compare.py's launch, at world 1
    return launch_system({"module": SYSTEMS[system], "world": 1}, spec, timeout=600)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), required=True)
    ap.add_argument("--models", default="deep,small")
    ap.add_argument("--systems", default="fz3,fz3-offload,ddp,fsdp2")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=os.path.join(HERE, "out", "gpu"))
    args = ap.parse_args(argv)
    systems = args.systems.split(",")
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
            stats = launch(system, {"model": model, "warmup": 2, "steps": 3, "mode": "stats",
                                    "options": OPTIONS.get(system, {})})[0]
            peak = stats.get("peak_device_bytes", stats.get("peak_rss", 0))
            rows.append({"model": model, "system": system, "device": args.device,
                         "median_ms": statistics.median(medians[system]), "launch_medians_ms": medians[system],
                         "peak_mib": peak / 2**20, "peak_kind": "device" if "peak_device_bytes" in stats else "rss",
                         "last_loss": losses[system]})
    with open(os.path.join(args.out, "steps.json"), "w") as f:
        json.dump(rows, f, indent=1)
    lines = ["| model | system | median step ms | launch medians | ÷ DDP | peak MiB | last loss |",
             "|---|---|---:|---|---:|---:|---:|"]
    for row in rows:
        ddp = next((x["median_ms"] for x in rows if x["model"] == row["model"] and x["system"] == "ddp"), None)
        ratio = f"{row['median_ms'] / ddp:.2f}" if ddp else "–"
        lines.append(f"| {row['model']} | {row['system']} | {row['median_ms']:.1f} | "
                     f"{' / '.join(f'{t:.1f}' for t in row['launch_medians_ms'])} | {ratio} | "
                     f"{row['peak_mib']:.0f} ({row['peak_kind']}) | {row['last_loss']:.6f} |")
    with open(os.path.join(args.out, "steps.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
