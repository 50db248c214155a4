"""What broadcasting rank 0's buffers before each forward costs (issue #23 point 6,
fz3.Options(broadcast_buffers=True), the default; fz3/shell/buffers.py): two fz3 engines in the
same 2 ranks, one with the broadcast and one without, stepping in turn.

    python3 bench/diagnostics/buffer_broadcast.py [--steps 30]

Two models: the small benchmark GPT (no buffers: the broadcast does nothing at all) and an MLP
with a BatchNorm1d after each of its 8 Linear(512, 512) layers (running mean, variance and batch
count: 8 x 1 025 buffer elements in two dtypes, so two broadcasts a forward). 2 gloo ranks x 1
thread, fz3 defaults, torch AdamW, 3 warm-up steps each, step time = the slower rank's; the
order alternates every step, and the figure is paired: the median over step pairs of (on ÷ off)
with its interquartile range (a shared 2-core machine varies +-20 % step to step). Peak RSS per
rank is reported beside it (the broadcast allocates one flat buffer per dtype, freed at once).
Writes its section of bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)  # bench/: the harness (bench_env, compare, systems) and RESULTS.md, out/
sys.path[:0] = [HERE, BENCH]
if __name__ == "__main__":
    from bench_env import ensure_env
    ensure_env(__file__)

WIDTH, DEPTH, BATCH = 512, 8, 64  # the BatchNorm MLP; BATCH rows per rank


def bn_model():
    import torch
    from torch import nn
    torch.manual_seed(0)
    layers = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 1))


def worker(rank: int, world: int, steps: int, model_name: str) -> dict:
    import torch
    import torch.distributed as dist
    import fz3
    from systems.common import (batches, engine_step_seconds, make_model, make_optimizer, paired_steps,
                                peak_rss_bytes, slowest_seconds)
    engines = {}
    for label, flag in (("on", True), ("off", False)):
        model = bn_model() if model_name == "batchnorm" else make_model(model_name)
        engines[label] = fz3.initialize(model, make_optimizer(model.parameters()), fz3.Config(),
                                        options=fz3.Options(broadcast_buffers=flag))
    if model_name == "batchnorm":
        g = torch.Generator().manual_seed(rank)
        data = [torch.randn(BATCH, WIDTH, generator=g) for _ in range(4)]

        def step(engine, i: int) -> float:
            return slowest_seconds(lambda: (engine.backward(engine(data[i % 4]).square().mean()), engine.step()))
    else:
        data = batches(model_name, rank, world, 4)

        def step(engine, i: int) -> float:
            return engine_step_seconds(engine, *data[i % len(data)])

    times = paired_steps(engines, step, steps)
    on = engines["on"]
    syncs = []
    for _ in range(20):  # the broadcast alone, as a forward runs it
        dist.barrier()
        t0 = time.perf_counter()
        on.buffers.sync()
        syncs.append(time.perf_counter() - t0)
    buffers = [b for b in on.module.buffers()]
    return {**times, "sync_ms": 1e3 * statistics.median(syncs), "buffers": len(buffers),
            "buffer_elements": sum(b.numel() for b in buffers), "slots": len(on.buffers.slots),
            "peak_rss_mib": peak_rss_bytes() / 2**20}


def measure(model: str, steps: int) -> str:
    import fz3.launch
    outs = fz3.launch.run(worker, world_size=2, args=(steps, model), timeout=1800, threads=1)
    out = outs[0]
    on, off = statistics.median(out["on"]), statistics.median(out["off"])
    ratios = [a / b for a, b in zip(out["on"], out["off"])]
    q1, ratio, q3 = statistics.quantiles(ratios, n=4)
    rss = " / ".join(f"{o['peak_rss_mib']:.0f}" for o in outs)
    return (f"| {model} | {out['buffers']} ({out['buffer_elements']:,} elements) | {1e3 * on:.1f} | {1e3 * off:.1f} | "
            f"**{ratio:.3f}** ({q1:.3f}–{q3:.3f}) | {out['sync_ms']:.3f} | {rss} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    rows = [measure(m, args.steps) for m in ("small", "batchnorm")]
    text = (f"`python3 bench/diagnostics/buffer_broadcast.py --steps {args.steps}`, "
            f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, 2 gloo ranks x 1 thread, fz3 "
            f"defaults, AdamW, two engines (broadcast_buffers on / off) stepping in turn, {args.steps} measured "
            "steps each. Both engines live in the same ranks, so the peak RSS is the pair's.\n\n"
            "| model | buffers | on: median step ms | off: median step ms | on ÷ off, median of pairs (IQR) "
            "| one broadcast alone, ms | peak RSS per rank, MiB (rank 0 / 1) |\n|---|---|---:|---:|---:|---:|---:|\n"
            + "\n".join(rows))
    print(text)
    from bench_env import replace_section
    begin, end = "<!-- buffer_broadcast:begin -->", "<!-- buffer_broadcast:end -->"
    replace_section(os.path.join(BENCH, "RESULTS.md"), f"{begin}\n## Buffers broadcast: what it costs\n\n{text}\n{end}",
                    begin, end)
    return 0


if __name__ == "__main__":
    sys.exit(main())
