"""How much of a profiled step's communication runs hidden behind compute (issue #48 point 5),
read off the chrome trace torch.profiler exported.

    hidden(path) -> {"comm_us", "hidden_us", "hidden_fraction", "compute_us", "comm_events", "source"}

On an accelerator the events are the device's kernels ("cat": "kernel"): communication is the
collectives' kernels (NCCL's "nccl...", HCCL's "hcom..."), compute every other kernel, and the
hidden time is the part of the communication's during which some compute kernel runs (its
intervals against the union of compute's). Without device kernels (a CPU run) the host's ops
stand in: communication the collectives' ops (c10d, gloo), compute the aten ops outside them.
"""
from __future__ import annotations

import json
import re

COMM = re.compile(r"nccl|hcom|hccl|c10d::|gloo|all_gather|reduce_scatter|allreduce|all_reduce", re.IGNORECASE)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _covered(a: float, b: float, union: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(b, d) - max(a, c)) for c, d in union)


def hidden(path: str) -> dict:
    with open(path) as f:
        events = [e for e in json.load(f).get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if kernels:
        source = "device kernels"
        comm = [e for e in kernels if COMM.search(e["name"])]
        compute = [e for e in kernels if not COMM.search(e["name"])]
    else:
        source = "host ops (no device kernels)"
        ops = [e for e in events if e.get("cat") == "cpu_op"]
        comm = [e for e in ops if COMM.search(e["name"])]
        spans = [(e["tid"], e["ts"], e["ts"] + e["dur"]) for e in comm]
        compute = [e for e in ops if e["name"].startswith("aten::") and not COMM.search(e["name"])
                   and not any(t == e["tid"] and a <= e["ts"] < b for t, a, b in spans)]
    union = _union([(e["ts"], e["ts"] + e["dur"]) for e in compute])
    comm_us = sum(b - a for a, b in _union([(e["ts"], e["ts"] + e["dur"]) for e in comm]))
    hidden_us = sum(_covered(a, b, union) for a, b in _union([(e["ts"], e["ts"] + e["dur"]) for e in comm]))
    return {"comm_us": comm_us, "hidden_us": hidden_us, "hidden_fraction": hidden_us / comm_us if comm_us else None,
            "compute_us": sum(b - a for a, b in union), "comm_events": len(comm), "source": source}
