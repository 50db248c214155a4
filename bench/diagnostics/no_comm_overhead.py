"""fz3's cost over the plain model when there is nothing to communicate: one rank (W=1).

    python bench/diagnostics/no_comm_overhead.py [--steps 40]

One process runs the plain model (AdamW, no hooks) and fz3 (defaults) in turn on the same
batches and reports the median CPU time per step of each, first step 4 on. Models:
    small  the benchmark's small GPT, rank 0's local batch of the 2-rank run (4 sequences)
    toy    the same module structure (4 blocks, 33 module calls, 52 params), d_model 16, vocab 64,
           seq 8: compute is negligible, so the difference is the per-call and per-param cost
           of hooks, autograd nodes and core transitions
At W=1 fz3's gathers and reduces move no bytes, so what is left is the shell, the core, the
autograd Function nodes and fz3's copies (grad -> bucket -> partition, shard -> full value).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)  # bench/: the harness (bench_env, compare, systems) and RESULTS.md, out/
sys.path[:0] = [HERE, BENCH]

from fz3.launch import run  # noqa: E402


def worker(rank: int, world: int, model: str, steps: int) -> dict:
    import torch

    import fz3
    from systems.common import batches, fz3_step, make_model, make_optimizer, plain_step
    from gpt import GPT, GPTConfig, markov_batch  # examples/gpt.py (systems put it on the path)

    if model == "toy":
        cfg = GPTConfig(vocab=64, d_model=16, n_head=4, n_layer=4, seq=8)
        build = lambda: GPT(cfg)  # noqa: E731
        data = [markov_batch(i, batch=2, seq=8, vocab=64) for i in range(steps)]
    else:
        build = lambda: make_model(model)  # noqa: E731
        data = batches(model, 0, 2, steps)  # rank 0's local batch of the 2-rank benchmark
    torch.manual_seed(0)
    plain = build()
    plain_opt = make_optimizer(plain.parameters())
    net = build()
    engine = fz3.initialize(net, make_optimizer(net.parameters()), fz3.Config())
    cpu: dict[str, list[float]] = {"plain": [], "fz3": []}
    for x, y in data:
        c0 = time.process_time()
        plain_step(plain, plain_opt, x, y).item()
        c1 = time.process_time()
        fz3_step(engine, x, y).item()
        cpu["plain"].append(c1 - c0)
        cpu["fz3"].append(time.process_time() - c1)
    return {k: sorted(v[3:])[len(v[3:]) // 2] * 1e3 for k, v in cpu.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    for model in ("toy", "small"):
        r = run(worker, world_size=1, args=(model, args.steps), timeout=900)[0]
        print(f"{model:<6} plain {r['plain']:7.1f} ms   fz3 {r['fz3']:7.1f} ms   "
              f"fz3 - plain {r['fz3'] - r['plain']:6.1f} ms CPU per step (median)")


if __name__ == "__main__":
    main()
