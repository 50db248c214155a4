"""Where fz3's share of one steady step goes, by core event: each kind of event (with the effects
it ran) timed through the engine's door, per step, on one rank beside the plain model.

    python bench/diagnostics/event_costs.py [--model deep] [--steps 40] [--config '{"param_persistence_threshold": 0}']
                                            [--md bench/RESULTS.md]   ('' prints only)

One process (world 1, gloo, one intra-op thread) builds the plain model and fz3 from one seed
(bench/systems/common.py's models, torch AdamW) and steps them in turn on the same batches; after
10 warm-up steps each `engine.apply` is timed with the effects it ran (hook effects included, so
a Leave's time holds its PreBackward node's forward). What the table does not hold is fz3's
cost outside the door: autograd running the PreBackward / PostBackward nodes and the grad hooks'
own calls (the "unaccounted" row: fz3's step less the plain step less the events)."""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)
sys.path.insert(0, BENCH)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="deep")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--config", default='{"param_persistence_threshold": 0}', help="fz3 Config fields, as JSON")
    ap.add_argument("--md", default=os.path.join(BENCH, "RESULTS.md"), help="RESULTS.md to write ('' prints only)")
    args = ap.parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    import fz3
    from bench_env import write_section, commit as bench_commit
    from systems.common import batches, fz3_step, make_model, make_optimizer, peak_rss_bytes, plain_step

    torch.manual_seed(0)
    plain = make_model(args.model)
    plain_opt = make_optimizer(plain.parameters())
    torch.manual_seed(0)
    model = make_model(args.model)
    engine = fz3.initialize(model, make_optimizer(model.parameters()), fz3.Config(**json.loads(args.config)))
    data = batches(args.model, 0, 1, 10 + args.steps)
    for x, y in data[:10]:
        plain_step(plain, plain_opt, x, y)
        fz3_step(engine, x, y)
    costs, ran = collections.defaultdict(list), []
    door, run = engine.apply, engine._run

    def timed_run(effects, tree, flat=None):
        ran.append(effects)
        return run(effects, tree, flat)

    def timed_apply(event, tree=None, flat=None):
        ran.clear()
        t = time.perf_counter()
        out = door(event, tree, flat)
        kinds = ",".join(sorted({type(e).__name__ for e in ran[0]})) if ran else ""
        costs[(type(event).__name__, kinds)].append(time.perf_counter() - t)
        return out

    engine._run, engine.apply = timed_run, timed_apply
    plain_ms, fz3_ms = [], []
    t0 = time.time()
    for x, y in data[10:]:
        t = time.perf_counter()
        plain_step(plain, plain_opt, x, y)
        plain_ms.append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        fz3_step(engine, x, y)
        fz3_ms.append((time.perf_counter() - t) * 1e3)
    n = args.steps
    commit = bench_commit()
    lines = [f"Command: `python bench/diagnostics/event_costs.py --model {args.model} --steps {n} --config "
             f"'{args.config}'` ({datetime.date.today()}, fz3 at {commit}, {platform.processor() or 'x86_64'}, "
             f"torch {torch.__version__}, {time.time() - t0:.0f} s). One rank, one intra-op thread, the plain "
             f"model and fz3 stepped in turn, {n} steps after 10 warm-up: fz3's step median "
             f"{statistics.median(fz3_ms):.2f} ms (timers on), the plain model's {statistics.median(plain_ms):.2f} "
             f"ms; peak RSS of the process (both models) {peak_rss_bytes() / 2**20:.0f} MiB. Each core event "
             "timed through the engine's door with the effects it ran:", "",
             "| event | effects it ran | per step | ms a step | median us |", "|---|---|---:|---:|---:|"]
    total = 0.0
    for (event, kinds), ts in sorted(costs.items(), key=lambda kv: -sum(kv[1])):
        total += sum(ts) / n
        lines.append(f"| {event} | {kinds or '-'} | {len(ts) / n:g} | {sum(ts) / n * 1e3:.2f} | "
                     f"{statistics.median(ts) * 1e6:.1f} |")
    rest = statistics.median(fz3_ms) - statistics.median(plain_ms) - total * 1e3
    lines += [f"| all events | | | {total * 1e3:.2f} | |", f"| unaccounted (outside the door) | | | {rest:.2f} | |"]
    write_section(args.md, "event_costs", f"fz3's share of a steady step by core event, {args.model} GPT (issue #48)",
                  "\n".join(lines) + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
