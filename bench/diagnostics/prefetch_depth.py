"""How many params are gathered (or in flight) at each module boundary of a training forward: real
DeepSpeed 0.19.8 ZeRO-3 against fz3, same GPT, same stage-3 budgets ([Note: prefetch bounds] in
fz3/core/param/fetch.py says why they differ).

    python3 bench/diagnostics/prefetch_depth.py [--models s3,small] [--steps 4] [--md FILE]

Budgets: DeepSpeed's defaults scaled to each model as they stand to the 1.02 B GPT (bench's b1):
prefetch_bucket_size 5e7, max_live_parameters and max_reuse_distance 1e9, each times numel /
1,024,051,200; param_persistence_threshold 1000, so the same params persist as in b1 with 1e5
(the vectors, not the matrices). 2 gloo ranks x 1 thread, torch AdamW, fp32, the same batch
every step (bench/systems/common.py). DeepSpeed: the model built outside zero.Init, as in
bench/compare.py. A forward pre- and post-hook on every module reads, on rank 0:
  DeepSpeed  the numel of params whose ds_status is AVAILABLE or INFLIGHT (a gather in flight
             holds its full buffer already)
  fz3        engine.stats()["live_numel"] (gathered or in flight, the core's count)
Steps after the first (the first records the trace in both) give the figures: the numel at the
forward's end and the largest at any boundary of the forward.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)  # bench/: the harness (bench_env, compare, systems) and RESULTS.md, out/
sys.path[:0] = [HERE, BENCH]
if __name__ == "__main__":
    from bench_env import ensure_env
    ensure_env(__file__)

B1_PARAMS = 1_024_051_200


def zero_config(numel: int) -> dict:
    """DeepSpeed's stage-3 defaults scaled from b1 to a model of `numel` params."""
    f = numel / B1_PARAMS
    return {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "reduce_scatter": True,
            "reduce_bucket_size": int(5e8 * f), "stage3_prefetch_bucket_size": int(5e7 * f),
            "stage3_param_persistence_threshold": 1000,
            "stage3_max_live_parameters": int(1e9 * f), "stage3_max_reuse_distance": int(1e9 * f)}


def worker(rank: int, world: int, system: str, model: str, steps: int) -> dict:
    import dataclasses

    import torch
    from memory import count_params
    from systems.common import batches, loss_fn
    from systems.deepspeed_z3 import ds_config
    numel = count_params(model)
    zero = zero_config(numel)
    torch.manual_seed(0)
    if system == "deepspeed":
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
        from systems.deepspeed_z3 import DeepSpeedZ3
        s = DeepSpeedZ3({"model": model, "options": {"zero": zero}}, world)
        params = list(s.model.parameters())

        def live() -> int:
            return sum(p.ds_numel for p in params if p.ds_status is not ZeroParamStatus.NOT_AVAILABLE)
    else:
        import fz3
        from systems.fz3_z3 import Fz3
        # the very config DeepSpeed gets, read as memory.py reads it
        fields = dataclasses.asdict(fz3.Config.from_deepspeed(ds_config(model, world, zero)))
        s = Fz3({"model": model, "options": {"config": fields}})

        def live() -> int:
            return s.engine.stats()["live_numel"]
    seen: list[int] = []
    for m in s.model.modules():
        m.register_forward_pre_hook(lambda *a: seen.append(live()))
        m.register_forward_hook(lambda *a: seen.append(live()))
    x, y = batches(model, rank, world, 1)[0]
    rows = []
    for _ in range(steps):
        seen.clear()
        out = s.engine(x)
        rows.append({"forward_end": live(), "forward_peak": max(seen), "boundaries": len(seen)})
        s.engine.backward(loss_fn(out, y))
        s.engine.step()
    return {"numel": numel, "zero": zero, "steps": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="s3,small")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--md", default=None, help="write the table here (default: print it)")
    args = ap.parse_args()
    import deepspeed
    import torch
    from fz3.launch import run
    lines = [f"`python3 bench/diagnostics/prefetch_depth.py --models {args.models} --steps {args.steps}`, "
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, "
             f"deepspeed {deepspeed.__version__}, fz3 at {_commit()}.", "",
             "| model | params | prefetch bucket / max live / reuse distance | system | gathered or in flight at the forward's end | largest at a forward boundary | share of the model at the end |",
             "|---|---:|---|---|---:|---:|---:|"]
    raw = {}
    for model in args.models.split(","):
        for system in ("deepspeed", "fz3"):
            res = run(worker, world_size=2, args=(system, model, args.steps), timeout=900)[0]
            raw[f"{model}/{system}"] = res
            later = res["steps"][1:]
            ends = sorted({r["forward_end"] for r in later})
            peaks = sorted({r["forward_peak"] for r in later})
            z = res["zero"]
            lines.append(f"| {model} | {res['numel']:,} | {z['stage3_prefetch_bucket_size']:,} / "
                         f"{z['stage3_max_live_parameters']:,} / {z['stage3_max_reuse_distance']:,} | {system} | "
                         f"{' / '.join(f'{e:,}' for e in ends)} | {' / '.join(f'{p:,}' for p in peaks)} | "
                         f"{max(ends) / res['numel']:.0%} |")
    text = "\n".join(lines) + "\n"
    os.makedirs(os.path.join(BENCH, "out"), exist_ok=True)
    with open(os.path.join(BENCH, "out", "prefetch_depth.json"), "w") as f:
        json.dump(raw, f, indent=1)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text)
    print(text)
    return 0


def _commit() -> str:
    import subprocess
    try:
        return subprocess.run(["git", "-C", os.path.dirname(BENCH), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


if __name__ == "__main__":
    sys.exit(main())
