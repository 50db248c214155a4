"""A/B of fz3 configs: one engine per config in the same 2 gloo ranks, stepping in turn.

Finer than compare.py for a single switch: the engines share the processes, the data and every
slow spell of the machine; the order alternates each step.

    python bench/diagnostics/ab_configs.py --model small --steps 27 \
        'p2p={}' 'native={"gloo_all_gather": "native", "gloo_reduce_scatter": "native"}'

Prints median and min step time per config (slower rank; the first 3 steps dropped).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)  # bench/: the harness (bench_env, compare, systems) and RESULTS.md, out/
sys.path[:0] = [HERE, BENCH]

from fz3.launch import run  # noqa: E402

WARMUP = 3


def worker(rank: int, world: int, model: str, variants: dict, steps: int) -> dict:
    import fz3
    from systems.common import batches, fz3_settings, fz3_step, make_model, make_optimizer

    engines = {}
    for name, cfg in variants.items():
        net = make_model(model)
        config, options = fz3_settings(cfg)
        engines[name] = fz3.initialize(net, make_optimizer(net.parameters()), config, options=options)
    times: dict[str, list[float]] = {k: [] for k in engines}
    for i, (x, y) in enumerate(batches(model, rank, world, steps + WARMUP)):
        order = list(engines.items())
        for name, engine in (order if i % 2 else order[::-1]):
            dist.barrier()
            t0 = time.perf_counter()
            fz3_step(engine, x, y).item()
            times[name].append(time.perf_counter() - t0)
    return {k: v[WARMUP:] for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("small", "wide"), default="small")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("variants", nargs="+", help='name={"config_field": value, ...} (JSON)')
    args = ap.parse_args()
    variants = {}
    for v in args.variants:
        name, sep, cfg = v.partition("=")
        if not sep:
            raise SystemExit(f"variant {v!r}: expected name={{json}}")
        variants[name] = json.loads(cfg)
    per_rank = run(worker, world_size=2, args=(args.model, variants, args.steps), timeout=1800)
    for name in variants:
        step = sorted(max(a, b) for a, b in zip(per_rank[0][name], per_rank[1][name]))
        print(f"{args.model} {name:<16} median {step[len(step) // 2] * 1e3:7.0f} ms   "
              f"min {step[0] * 1e3:7.0f} ms")


if __name__ == "__main__":
    main()
