"""What the always-on divergence check costs (issue #13: at most 2 % of step time): the small
benchmark GPT trained by two fz3 engines in the same 2 ranks, one built with the check
(fz3/interpreters/agreement.py) and one without (FZ3_DIVERGENCE_CHECK=0), stepping in turn.

    python3 bench/diagnostics/divergence_overhead.py [--steps 30] [--model small] [--md FILE]

2 gloo ranks x 1 thread, fz3 defaults (a tiny model per rank is cheap: both engines fit), 3
warm-up steps each; step time = the slower rank's; the order alternates every step. Steps on
this shared 2-core machine vary by +-20 % from one to the next, more than the effect measured,
so the figure is paired: the median over step pairs of (on ÷ off), each pair run back to back,
with the interquartile range of those ratios beside it. Writes its section of bench/RESULTS.md,
or of `--md FILE` (`--md ''`: print only; a run on another model than the section's, say).
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)  # bench/: the harness (bench_env, compare, systems) and RESULTS.md, out/
sys.path[:0] = [HERE, BENCH]
if __name__ == "__main__":
    from bench_env import ensure_env
    ensure_env(__file__)


def worker(rank: int, world: int, steps: int, model_name: str) -> dict:
    import fz3
    from systems.common import batches, engine_step_seconds, make_model, make_optimizer, paired_steps
    engines = {}
    for label, flag in (("on", "1"), ("off", "0")):
        os.environ["FZ3_DIVERGENCE_CHECK"] = flag
        model = make_model(model_name)
        engines[label] = fz3.initialize(model, make_optimizer(model.parameters()), fz3.Config())
    assert engines["on"].interp.agreement is not None and engines["off"].interp.agreement is None
    data = batches(model_name, rank, world, 4)

    def step(engine, i: int) -> float:
        return engine_step_seconds(engine, *data[i % len(data)])

    times = paired_steps(engines, step, steps)
    ag = engines["on"].interp.agreement
    return {**times, "checks_per_step": ag.checks / (3 + steps), "check_ms_per_step": 1e3 * ag.seconds / (3 + steps)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--model", default="small")
    ap.add_argument("--md", default=os.path.join(BENCH, "RESULTS.md"),
                    help="the markdown file whose divergence_overhead section the run replaces ('': none)")
    args = ap.parse_args()
    import fz3.launch
    out = fz3.launch.run(worker, world_size=2, args=(args.steps, args.model), timeout=1800, threads=1)[0]
    on, off = statistics.median(out["on"]), statistics.median(out["off"])
    ratios = [a / b for a, b in zip(out["on"], out["off"])]
    q1, ratio, q3 = statistics.quantiles(ratios, n=4)
    text = (f"`python3 bench/diagnostics/divergence_overhead.py --steps {args.steps} --model {args.model}`, "
            f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, 2 gloo ranks x 1 thread, fz3 "
            f"defaults, two engines stepping in turn ({args.steps} measured steps each).\n\n"
            f"| divergence check | median step ms | min–max ms |\n|---|---:|---:|\n"
            f"| on (always, the default) | {1e3 * on:.1f} | {1e3 * min(out['on']):.1f}–{1e3 * max(out['on']):.1f} |\n"
            f"| off (FZ3_DIVERGENCE_CHECK=0) | {1e3 * off:.1f} | {1e3 * min(out['off']):.1f}–{1e3 * max(out['off']):.1f} |\n\n"
            f"Check on ÷ off, the median over step pairs: **{ratio:.3f}** ({100 * (ratio - 1):+.1f} %; target "
            f"≤ +2 %; interquartile range {q1:.3f}–{q3:.3f}; ratio of the medians {on / off:.3f}), "
            f"{out['checks_per_step']:.1f} descriptor exchanges per step, {out['check_ms_per_step']:.2f} ms per "
            "step inside them on rank 0 (mostly waiting for the other rank to reach the same collective).")
    print(text)
    if args.md:
        from bench_env import replace_section
        begin, end = "<!-- divergence_overhead:begin -->", "<!-- divergence_overhead:end -->"
        replace_section(args.md, f"{begin}\n## The divergence check: what it costs\n\n{text}\n{end}", begin, end)
    return 0


if __name__ == "__main__":
    sys.exit(main())
