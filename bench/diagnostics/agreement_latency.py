"""What one divergence check adds to a collective waited at once (an on-demand gather), by where
its descriptors travel (fz3/interpreters/agreement.py, [Note: descriptors beside the data]).

    python3 bench/diagnostics/agreement_latency.py [--reps 300] [--mib 1]

2 gloo ranks x 1 thread. Each repetition: a barrier, then a point-to-point all-gather of `mib`
MiB (fz3/interpreters/p2p.py) posted and waited at once, timed on each rank; the median over
`reps` (with the quartiles), for three ways taking turns:

    unchecked      the gather alone, under a counter's tag
    side group     descriptors exchanged over a second gloo group, data under their tag
    same group     descriptors on the training group itself, under their reserved tag (fz3's)

and a descriptor exchange alone, against an 8-byte all-reduce. Writes its section of
bench/RESULTS.md.
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


def worker(rank: int, world: int, reps: int, mib: float) -> dict:
    import torch
    import torch.distributed as dist
    from fz3.interpreters import agreement, p2p
    from fz3.interpreters.transport import TorchTransport
    comm = TorchTransport()
    same = agreement.Agreement(comm, str)
    side = agreement.Agreement(TorchTransport(dist.new_group(backend="gloo")), str)
    n = int(mib * (1 << 20)) // 4
    fulls, shards = [torch.empty(n)], [torch.ones(-(-n // world))]

    def gather(check):
        def run(i: int) -> None:
            if check is None:
                p2p.all_gather(fulls, shards, comm, tag=1 + i % 1000).wait()
                return
            posted = check.post(agreement.GATHER, (1, 2, 3), n)
            work = p2p.all_gather(fulls, shards, comm, tag=posted.tag)
            check.guard(posted, work).wait()
        return run

    def exchange(i: int) -> None:
        same.check(agreement.GATHER, (1,), 1)

    def all_reduce(i: int) -> None:
        dist.all_reduce(torch.zeros(1, dtype=torch.float64))

    ways = {"unchecked": gather(None), "side group": gather(side), "same group": gather(same),
            "descriptor exchange alone": exchange, "8-byte all-reduce": all_reduce}
    times: dict[str, list[float]] = {k: [] for k in ways}
    for i in range(reps):  # the ways take turns, so a change in the machine's load hits them alike
        for name, run in ways.items():
            dist.barrier()
            t0 = time.perf_counter()
            run(i)
            times[name].append(time.perf_counter() - t0)
    return {name: [statistics.quantiles(t, n=4)[k] for k in range(3)] for name, t in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--mib", type=float, default=1.0)
    args = ap.parse_args()
    import fz3.launch
    outs = fz3.launch.run(worker, world_size=2, args=(args.reps, args.mib), timeout=900, threads=1)
    rows = "\n".join(f"| {name} | " + " | ".join(f"**{1e3 * out[name][1]:.2f}** ({1e3 * out[name][0]:.2f}–"
                                                  f"{1e3 * out[name][2]:.2f})" for out in outs) + " |" for name in outs[0])
    text = (f"`python3 bench/diagnostics/agreement_latency.py --reps {args.reps} --mib {args.mib:g}`, "
            f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, 2 gloo ranks x 1 thread; "
            f"median ms (quartiles) over {args.reps} repetitions, each after a barrier, the ways taking turns.\n\n"
            f"| on-demand gather of {args.mib:g} MiB | rank 0 ms | rank 1 ms |\n|---|---:|---:|\n{rows}")
    print(text)
    from bench_env import replace_section
    begin, end = "<!-- agreement_latency:begin -->", "<!-- agreement_latency:end -->"
    replace_section(os.path.join(BENCH, "RESULTS.md"),
                    f"{begin}\n### Where the descriptors travel: one collective's latency\n\n{text}\n{end}", begin, end)
    return 0


if __name__ == "__main__":
    sys.exit(main())
