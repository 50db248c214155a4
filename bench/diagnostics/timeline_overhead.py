"""What fz3.timeline costs when on: step time inside a timeline block against the same ranks'
steps outside one, on the small benchmark GPT (issue #13: at most 10 %).

    python3 bench/diagnostics/timeline_overhead.py [--rounds 8] [--steps 3]

2 gloo ranks x 1 thread, fz3 defaults, bench/systems/common.py's model, batches and AdamW. Each
round: `steps` steps outside a block, then `steps` inside `with fz3.timeline(engine, path)`,
alternating which comes first; step time = the slower rank's. The block's exit (gathering the
events to rank 0 and writing the JSON) is reported apart: it happens once per block, not per
step. Writes its section of bench/RESULTS.md.
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


def worker(rank: int, world: int, rounds: int, steps: int, path: str) -> dict:
    import fz3
    from systems.common import batches, engine_step_seconds, make_model, make_optimizer
    model = make_model("small")
    engine = fz3.initialize(model, make_optimizer(model.parameters()), fz3.Config())
    data = batches("small", rank, world, 4)

    def step(i: int) -> float:
        return engine_step_seconds(engine, *data[i % len(data)])

    for i in range(3):
        step(i)  # warm-up: the trace is recorded
    plain, on, exits, events = [], [], [], 0
    for r in range(rounds):
        for inside in ((False, True) if r % 2 == 0 else (True, False)):
            if not inside:
                plain += [step(i) for i in range(steps)]
                continue
            block = fz3.timeline(engine, path)
            block.__enter__()
            on += [step(i) for i in range(steps)]
            t0 = time.perf_counter()
            block.__exit__(None, None, None)
            exits.append(time.perf_counter() - t0)
    if rank == 0:
        import json
        events = len(json.load(open(path))["traceEvents"])
    return {"plain": plain, "on": on, "exits": exits, "events": events}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    import fz3.launch
    path = os.path.join(BENCH, "out", "timeline_overhead.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    out = fz3.launch.run(worker, world_size=2, args=(args.rounds, args.steps, path), timeout=1200, threads=1)[0]
    plain, on = statistics.median(out["plain"]), statistics.median(out["on"])
    text = (f"`python3 bench/diagnostics/timeline_overhead.py --rounds {args.rounds} --steps {args.steps}`, "
            f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, small GPT, 2 gloo ranks x 1 "
            f"thread, fz3 defaults; {len(out['plain'])} steps each way, interleaved by round.\n\n"
            f"| | median step ms | min–max ms |\n|---|---:|---:|\n"
            f"| outside a timeline block | {1e3 * plain:.1f} | {1e3 * min(out['plain']):.1f}–{1e3 * max(out['plain']):.1f} |\n"
            f"| inside `fz3.timeline` | {1e3 * on:.1f} | {1e3 * min(out['on']):.1f}–{1e3 * max(out['on']):.1f} |\n\n"
            f"Overhead on: **{100 * (on / plain - 1):+.1f} %** of step time (target ≤ 10 %). The block's exit "
            f"(events gathered to rank 0, JSON written: {out['events']} events for {args.steps} steps): "
            f"median {1e3 * statistics.median(out['exits']):.0f} ms, once per block.")
    print(text)
    from bench_env import replace_section
    begin, end = "<!-- timeline_overhead:begin -->", "<!-- timeline_overhead:end -->"
    replace_section(os.path.join(BENCH, "RESULTS.md"), f"{begin}\n## fz3.timeline: what it costs when on\n\n{text}\n{end}", begin, end)
    return 0


if __name__ == "__main__":
    sys.exit(main())
