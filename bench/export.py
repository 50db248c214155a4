"""Full weights out, bounded (issue #50 point 6): the peak memory of engine.full_params against its
bucket size, beside the whole-model export DeepSpeed's integrations use.

    python bench/export.py [--md bench/RESULTS.md]

The GPT of examples/gpt.py (vocab 8192, d_model 512, 8 layers: 33.6 M params, fp32) on 2 gloo
ranks, DeepSpeed's defaults but every matrix sharded (param_persistence_threshold=0), one process
per case. After a training step, each rank resets its peak RSS (/proc/self/clear_refs), exports
every weight (copying each into a preallocated host buffer, as a weight sync's receive would,
so what the export keeps is only its own), and reports its peak RSS above the RSS before, and
fz3's own count of gathered bytes at the peak (live_numel). Cases: full_params at three bucket
sizes (the smallest one the largest param, the 16 MiB embedding), and
engine._zero3_consolidated_16bit_state_dict() (DeepSpeed's, which Accelerate's get_state_dict and
save_model call: the whole model gathered into one dict on rank 0, a param at a time).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, HERE)

GPT = dict(vocab=8192, d_model=512, n_head=8, n_layer=8, seq=32)
MIB = 2**20
CASES = (("full_params, 16 MiB buckets", 16 * MIB), ("full_params, 64 MiB buckets", 64 * MIB),
         ("full_params, 256 MiB buckets (the whole model)", 256 * MIB),
         ("_zero3_consolidated_16bit_state_dict", None))


def _status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    return 0


def _rank(rank: int, world: int, bucket) -> dict:
    import torch
    import fz3
    from gpt import GPT as Model, GPTConfig, loss_fn, markov_batch
    torch.manual_seed(0)
    model = Model(GPTConfig(**GPT))
    numel = sum(p.numel() for p in model.parameters())
    engine = fz3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.01),
                            fz3.Config(param_persistence_threshold=0))
    x, y = markov_batch(0, batch=2, seq=GPT["seq"], vocab=GPT["vocab"])
    engine.backward(loss_fn(engine(x[rank:rank + 1]), y[rank:rank + 1]))
    engine.step()
    sink = torch.zeros(numel, dtype=torch.float32)  # where a weight sync receives them: resident before
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak RSS starts again from here
    before = _status("VmRSS")
    live, done = 0, 0
    t0 = time.perf_counter()
    if bucket is None:
        sd = engine._zero3_consolidated_16bit_state_dict()
        live = sum(t.numel() * t.element_size() for t in sd.values()) if sd else 0
        del sd
    else:
        for _, t in engine.full_params(bucket_bytes=bucket):
            sink[done:done + t.numel()].copy_(t.reshape(-1))
            done += t.numel()
            live = max(live, engine.stats()["live_numel"] * 4)
    seconds = time.perf_counter() - t0
    return {"peak_above": _status("VmHWM") - before, "live": live, "seconds": seconds, "numel": numel}


def main() -> None:
    from bench_env import ensure_env, write_section, commit as bench_commit
    ensure_env(__file__)
    from fz3 import launch
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--md", default=os.path.join(HERE, "RESULTS.md"))
    args = ap.parse_args()
    t_start = time.time()
    rows = {name: launch.run(_rank, world_size=2, args=(bucket,), timeout=600) for name, bucket in CASES}
    commit = bench_commit()
    numel = rows[CASES[0][0]][0]["numel"]
    lines = [f"Command: `python bench/export.py` ({datetime.date.today()}, fz3 at {commit}, "
             f"{platform.processor() or 'x86_64'}, {time.time() - t_start:.0f} s). examples/gpt.py GPT("
             f"{', '.join(f'{k}={v}' for k, v in GPT.items())}): {numel:,} params, {numel * 4 / MIB:.0f} MiB in fp32, "
             "on 2 gloo ranks; per rank, during the export: peak RSS above the RSS before it (the heap reuses "
             "what the training step freed, so a small bucket may need no new page), fz3's gathered bytes at the "
             "peak (for the 16-bit state dict: the dict rank 0 returns), seconds:", "",
             "| export | rank 0 peak RSS above | rank 1 peak RSS above | gathered at the peak (rank 0) | seconds |",
             "|---|---:|---:|---:|---:|"]
    for name, _ in CASES:
        r0, r1 = rows[name]
        lines.append(f"| {name} | {r0['peak_above'] / MIB:.1f} MiB | {r1['peak_above'] / MIB:.1f} MiB | "
                     f"{r0['live'] / MIB:.1f} MiB | {max(r0['seconds'], r1['seconds']):.2f} |")
    write_section(args.md, "export", "Full weights out, bounded (issue #50)", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
