"""Where a step's time goes by phase, fz3 against DDP: forward, backward, optimizer step.

    python bench/diagnostics/phases.py [--model small] [--steps 15] [--launches 2] [--md FILE]

Launches alternate (DDP, fz3, DDP, fz3, ...); each runs 2 gloo ranks x 1 intra-op thread on
the benchmark model's local batches (bench/systems/common.py, as compare.py) and times every
phase of every step after 5 warm-up steps: the wall time, the process CPU time (gloo's threads
included) and the minor page faults. DDP is torch's DistributedDataParallel with its defaults
and `zero_grad()` after the step; fz3 its defaults (`fz3.Config()`). The table gives, per
system, the median over steps of each phase, averaged over the two ranks, then the median over
launches.

Why: bench/compare.py says how the whole step compares. This says in which phase the
difference lives: on the small GPT DDP's forward is the plain model's (nothing to
communicate), its all-reduce sits in the backward; fz3 gathers the params the step partitioned
in the forward and reduce-scatters in the backward (bench/RESULTS.md, "The small GPT's gap to
DDP, by phase").
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)  # bench/: the harness (bench_env, compare, systems) and RESULTS.md, out/
sys.path[:0] = [HERE, BENCH]

from fz3.launch import run  # noqa: E402

PHASES = ("forward", "backward", "step")  # the step: the optimizer's (fz3: and its refresh)
WARMUP = 5


def worker(rank: int, world: int, system: str, model: str, steps: int) -> dict:
    import resource

    import torch

    from systems.common import batches, loss_fn, make_model, make_optimizer

    net = make_model(model)
    if system == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(net)
        opt = make_optimizer(net.parameters())

        def backward(loss):
            loss.backward()

        def step():
            opt.step()
            opt.zero_grad()
    else:
        import fz3
        engine = fz3.initialize(net, make_optimizer(net.parameters()), fz3.Config())
        net, backward, step = engine, engine.backward, engine.step

    def faults() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    seen: dict[str, list[tuple[float, float, int]]] = {p: [] for p in PHASES}
    for i, (x, y) in enumerate(batches(model, rank, world, WARMUP + steps)):
        marks = [(time.perf_counter(), time.process_time(), faults())]
        loss = loss_fn(net(x), y)
        marks.append((time.perf_counter(), time.process_time(), faults()))
        backward(loss)
        marks.append((time.perf_counter(), time.process_time(), faults()))
        step()
        loss.item()
        marks.append((time.perf_counter(), time.process_time(), faults()))
        if i >= WARMUP:
            for p, (a, b) in zip(PHASES, zip(marks, marks[1:])):
                seen[p].append((b[0] - a[0], b[1] - a[1], b[2] - a[2]))
    return {p: tuple(statistics.median(v[k] for v in seen[p]) for k in range(3)) for p in PHASES}


def launch(system: str, model: str, steps: int) -> dict[str, tuple[float, float, float]]:
    """{phase: (wall ms, CPU ms, faults)}, each the mean over the ranks of their medians."""
    ranks = run(worker, world_size=2, args=(system, model, steps), timeout=900, threads=1)
    return {p: tuple(statistics.mean(r[p][k] for r in ranks) * (1e3 if k < 2 else 1) for k in range(3))
            for p in PHASES}


def table(results: dict[str, list[dict]], model: str, steps: int, launches: int) -> str:
    lines = [f"`python bench/diagnostics/phases.py --model {model} --steps {steps} --launches {launches}` "
             f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}): per phase, the median over "
             f"{steps} steps, mean over 2 ranks, median over {launches} launches; each launch's wall ms in brackets",
             "",
             "| system | " + " | ".join(f"{p} wall ms | {p} CPU ms | {p} faults" for p in PHASES) + " | whole step wall ms |",
             "|---|" + "---:|" * (3 * len(PHASES) + 1)]
    for system, runs in results.items():
        cells = []
        for p in PHASES:
            med = [statistics.median(r[p][k] for r in runs) for k in range(3)]
            each = ", ".join(f"{r[p][0]:.1f}" for r in runs)
            cells += [f"{med[0]:.1f} ({each})", f"{med[1]:.1f}", f"{med[2]:.0f}"]
        total = statistics.median(sum(r[p][0] for p in PHASES) for r in runs)
        lines.append(f"| {system} | " + " | ".join(cells) + f" | {total:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small", choices=("deep", "small", "wide"))
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--launches", type=int, default=2)
    ap.add_argument("--md", help="also write the table to this file")
    args = ap.parse_args()
    results: dict[str, list[dict]] = {"ddp": [], "fz3": []}
    for _ in range(args.launches):
        for system in results:
            results[system].append(launch(system, args.model, args.steps))
    out = table(results, args.model, args.steps, args.launches)
    print(out)
    if args.md:
        with open(args.md, "w") as f:
            f.write(out)


if __name__ == "__main__":
    main()
