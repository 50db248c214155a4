"""What the replay's schedules hold (fz3/core/replay.py): the Python heap's growth over 30 steps
of the deep narrow GPT on one thread rank, Options(replay=True) against False, the engine alive.

    python bench/diagnostics/replay_memory.py
    python bench/diagnostics/replay_memory.py --synthetic  # bench/core_overhead.py's models, 100 to
                                                           # 10 000 modules, the core alone: one
                                                           # schedule's heap

tracemalloc counts Python's allocations (the schedules' states, events and effects), not tensors.
"""
from __future__ import annotations

import gc
import os
import sys
import tracemalloc

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)  # bench/: the harness (bench_env, compare, systems) and RESULTS.md, out/
sys.path[:0] = [HERE, BENCH]  # systems.*

CONFIGS = {"defaults": {}, "sharded, gas 2": {"param_persistence_threshold": 0, "gradient_accumulation_steps": 2}}


def worker(rank: int, world: int, fields: dict, replay: bool) -> tuple[int, int, float]:
    import torch
    import fz3
    from systems.common import batches, fz3_settings, fz3_step, make_model, make_optimizer
    torch.manual_seed(0)
    data = batches("deep", rank, world, 4)
    model = make_model("deep")
    config, options = fz3_settings(fields)
    engine = fz3.initialize(model, make_optimizer(model.parameters()), config, options=options.replace(replay=replay))
    fz3_step(engine, *data[0])
    gc.collect()
    start = tracemalloc.get_traced_memory()[0]
    for k in range(30):
        fz3_step(engine, *data[k % 4])
    gc.collect()
    stats = engine.stats()
    return stats["replay_schedules"], stats["replay_events_kept"], (tracemalloc.get_traced_memory()[0] - start) / 2**20


def synthetic(sizes=(100, 1000, 10000)) -> None:
    """The core alone on core_overhead's steady pass (defaults): the heap a schedule holds."""
    import core_overhead as co
    from fz3.core import replay
    cfg = co.CONFIGS["defaults"]
    print("| modules | schedules | events kept | heap MiB (with replay, minus without) |\n|---:|---:|---:|---:|")
    for n in sizes:
        spec, order = co.synthetic(n, 2, cfg), list(range(1, n))
        grew = []
        for keep in (False, True):
            box = [(replay.start(co.initial(spec, "calls")), co.steady_events(spec, order, cfg),
                    lambda cell, e, config, keep=keep: replay.advance(cell, e, config=config, keep=keep))]
            gc.collect()
            start = tracemalloc.get_traced_memory()[0]
            for _ in range(6):
                co.one_pass_steady(box, order, cfg)
            gc.collect()
            grew.append(tracemalloc.get_traced_memory()[0] - start)
            cell = box[0][0]
        print(f"| {n} | {len(cell.schedules)} | {sum(len(x.events) for x in cell.schedules)} | "
              f"{(grew[1] - grew[0]) / 2**20:.2f} |")


def main() -> int:
    from fz3.interpreters.threads import run_threads
    tracemalloc.start()
    if "--synthetic" in sys.argv[1:]:
        synthetic()
        return 0
    print("| config | replay | schedules | events kept | heap growth MiB |\n|---|---|---:|---:|---:|")
    for name, fields in CONFIGS.items():
        for replay in (False, True):
            n, kept, mib = run_threads(worker, 1, args=(fields, replay))[0]
            print(f"| {name} | {'on' if replay else 'off'} | {n} | {kept} | {mib:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
