"""One launch of fz3 or DDP on the deep narrow GPT of issue #27 (bench/systems/common.py "deep"):
median and min step ms (the slower rank's), peak RSS per rank with a 4th argument.

    PYTHONPATH=<checkout> python bench/diagnostics/deep_ab.py bench fz3|ddp STEPS [stats]

For A/B runs of two checkouts' fz3 on the same bench code (PYTHONPATH picks the fz3), until
bench/diagnostics/overhead.py (issue #27) gives the full table against DDP, FSDP2 and DeepSpeed."""
import json
import os
import statistics
import sys

if __name__ == "__main__":
    bench, system, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    sys.path.insert(0, bench)  # spawned ranks inherit sys.path
    import fz3
    from compare import launch

    spec = {"model": "deep", "warmup": 5, "steps": steps, "mode": "stats" if len(sys.argv) > 4 else "time",
            "options": {"config": {}} if system == "fz3" else {}}
    outs = launch({"module": {"fz3": "fz3_z3", "ddp": "ddp"}[system], "world": 2}, spec, timeout=600)
    t = [max(a, b) for a, b in zip(outs[0]["times"], outs[1]["times"])]
    print(json.dumps({"system": system, "fz3": os.path.dirname(fz3.__file__), "median_ms": statistics.median(t) * 1e3,
                      "min_ms": min(t) * 1e3, "peak_rss_mib": max(o.get("peak_rss", 0) for o in outs) / 2**20,
                      "loss_last": outs[0]["losses"][-1]}))
