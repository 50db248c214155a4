"""Bytes per parameter per rank that fz3 holds at ZeRO stages 0-3, by kind, beside the ZeRO paper's
theory and what real DeepSpeed 0.19.8 held on the same model (tests/data/deepspeed_stage_memory_0.19.8.json,
bench/deepspeed_records/deepspeed_stage_memory.py). fz3 runs on 2 gloo ranks (fz3.launch.run):

    python bench/diagnostics/stage_memory.py [--json out.json]

The model and the points are DeepSpeed's record's: 4 Linear(1024, 1024) (4,198,400 params),
gradient_accumulation_steps 2, AdamW, fp32 / bf16 / fp16; counted in the second window (AdamW's
state exists), after its first backward (mid-window), after its boundary backward (before the
step), and after the step. Kinds, from engine.stats() and the model's .grad:

    params    what the model's params hold: the full compute-dtype values live (stages 0-2: all of
              them, always) and the compute shards (at stage 0 the full value is the shard itself;
              in fp32 the shard is the master)
    grads     grad partitions (fp32) and grads in param.grad (stages 0 and 1 keep them whole there
              until the boundary's step())
    masters   fp32 master shards (at stage 0 the whole params), where not counted as params
    states    the optimizer's (exp_avg, exp_avg_sq, step)
Each storage is counted once, under the first kind that reaches it (as DeepSpeed's count).

Theory (Adam, N ranks): params P (4 or 2 bytes), grads G, masters M = 4 (fp32 compute: 0, the
params are the masters), states K = 8; stage 0: P + G + M + K; 1: P + G + (M + K)/N; 2: P +
(G + M + K)/N; 3: (P + G + M + K)/N. Buffers (DeepSpeed's IPG buckets, fz3's pools) are left out
of the totals on both sides: they depend on reduce_bucket_size, not on the model.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from fz3 import launch  # noqa: E402

WIDTH, LAYERS, WORLD = 1024, 4, 2
POINTS = ("mid_window_after_backward", "boundary_after_backward", "after_step")
KINDS = ("params", "grads", "masters", "states")
RECORD = os.path.join(ROOT, "tests", "data", "deepspeed_stage_memory_0.19.8.json")


def _count(engine) -> dict[str, int]:
    """Bytes by kind, each storage counted once, under the first kind that reaches it (as
    bench/deepspeed_records/deepspeed_stage_memory.py counts DeepSpeed's): at stage 0 in fp32 a param's full value
    is its master, counted as params."""
    store, seen = engine.store, set()

    def once(tensors) -> int:
        total = 0
        for t in tensors:
            storage = t.untyped_storage()
            if t.numel() and storage._cdata not in seen:
                seen.add(storage._cdata)
                total += storage.nbytes()
        return total

    state = [v for s in engine.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {"params": once([p.data for p in engine.tables.params] + list(store.shards)),
            "grads": once([p.grad for p in engine.tables.params if p.grad is not None] + store.segment_grads()),
            "masters": once(store.masters), "states": once(state)}


def _run(rank: int, world: int, stage: int, precision: str) -> dict:
    import fz3
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    cfg = fz3.Config(stage=stage, compute_dtype=precision, gradient_accumulation_steps=2)
    engine = fz3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), cfg)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    g = torch.Generator().manual_seed(rank)
    out = {}
    for window in range(2):
        for micro in range(2):
            loss = engine(torch.randn(2, WIDTH, generator=g, dtype=torch.float32).to(dtype)).float().square().mean()
            engine.backward(loss)
            if window == 1:
                out[POINTS[micro]] = _count(engine)
            engine.step()
        if window == 1:
            out[POINTS[2]] = _count(engine)
    n = sum(shape.numel() for shape in engine.store.shapes)
    return {point: {k: v / n for k, v in kinds.items()} for point, kinds in out.items()}


def theory(stage: int, precision: str, world: int = WORLD) -> float:
    P = G = 4 if precision == "fp32" else 2
    M, K = (0 if precision == "fp32" else 4), 8
    return {0: P + G + M + K, 1: P + G + (M + K) / world, 2: P + (G + M + K) / world,
            3: (P + G + M + K) / world}[stage]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write the table as JSON")
    args = parser.parse_args()
    deepspeed = json.load(open(RECORD))["runs"]
    rows = []
    for precision in ("fp32", "bf16", "fp16"):
        for stage in (0, 1, 2, 3):
            got = launch.run(_run, world_size=WORLD, args=(stage, precision), timeout=600)
            assert got[0] == got[1], "ranks differ"
            ds = deepspeed.get(f"{precision}_stage{stage}")
            rows.append({"case": f"{precision} stage {stage}", "theory": theory(stage, precision),
                         **{p: got[0][p] for p in POINTS},
                         "deepspeed": None if ds is None else {p: ds[p]["total_per_param_without_buffers"]
                                                               for p in POINTS}})
    print(f"bytes per param per rank, {WORLD} ranks, {LAYERS} x Linear({WIDTH}, {WIDTH}), AdamW, gas 2")
    print(f"{'case':<14} {'theory':>6}  {'fz3 mid':>8} {'boundary':>8} {'after':>6}   "
          f"{'DS mid':>6} {'boundary':>8} {'after':>6}   fz3 at the boundary by kind")
    for r in rows:
        fz = [sum(r[p].values()) for p in POINTS]
        ds = [r["deepspeed"][p] for p in POINTS] if r["deepspeed"] else [float("nan")] * 3
        kinds = ", ".join(f"{k} {r['boundary_after_backward'][k]:.2f}" for k in KINDS)
        print(f"{r['case']:<14} {r['theory']:>6.2f}  {fz[0]:>8.2f} {fz[1]:>8.2f} {fz[2]:>6.2f}   "
              f"{ds[0]:>6.2f} {ds[1]:>8.2f} {ds[2]:>6.2f}   {kinds}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
