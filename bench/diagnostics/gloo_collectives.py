"""How long gloo's collectives take on this machine, for the buffer sizes of the wide model.

Two local ranks, one intra-op thread each, fp32. For a buffer of N elements (default: the wide
GPT's 29,420,544 parameters), times the issue call and the wait of:
    all_gather      shard (N/2,) -> (N,)
    reduce_scatter  (N,) -> (N/2,)
    all_reduce      (N,) in place
    all_gather as all_reduce: zero an (N,) buffer, copy the shard in, all-reduce (SUM)
    all_gather p2p  / reduce_scatter p2p: fz3/interpreters/p2p.py (isend/irecv between ranks;
                    the reduce's sum into the own partition is inside the wait)

    python bench/diagnostics/gloo_collectives.py [--numel N] [--repeats 5]

Why: fz3's interpreter picks, per backend, which collective carries a reduce
(fz3.Options.gloo_all_gather, gloo_reduce_scatter); these figures are the reason. CPU is the
process CPU time of the slower rank over issue + wait (gloo's threads included).
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from fz3.interpreters import p2p
from fz3.interpreters.transport import TorchTransport
from fz3.launch import run


def worker(rank: int, world: int, numel: int, repeats: int) -> dict:
    n = numel - numel % world
    full, shard = torch.randn(n), torch.randn(n // world)
    out_full, out_shard = torch.empty(n), torch.empty(n // world)

    def gather_by_reduce():
        out_full.zero_()
        out_full.view(world, -1)[rank].copy_(shard)
        return dist.all_reduce(out_full, async_op=True)

    def gather_p2p():
        return p2p.all_gather([out_full], [shard], TorchTransport(), tag=1)

    def reduce_p2p():
        work, result = p2p.reduce_scatter([full], scratch, TorchTransport(), tag=2)
        return _Then(work, result)

    scratch = torch.empty(p2p.scratch_numel([n], rank, world))
    ops = {"all_gather": lambda: dist.all_gather_into_tensor(out_full, shard, async_op=True),
           "reduce_scatter": lambda: dist.reduce_scatter_tensor(out_shard, full, async_op=True),
           "all_reduce": lambda: dist.all_reduce(full, async_op=True),
           "all_gather as all_reduce": gather_by_reduce,
           "all_gather p2p": gather_p2p, "reduce_scatter p2p": reduce_p2p}
    res = {}
    for name, op in ops.items():
        times = []
        for _ in range(repeats + 1):  # the first touches fresh memory: dropped
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            work = op()
            t1 = time.perf_counter()
            work.wait()
            times.append((t1 - t0, time.perf_counter() - t1, time.process_time() - c0))
        res[name] = times[1:]
    return res


class _Then:
    def __init__(self, work, then) -> None:
        self.work, self.then = work, then

    def wait(self) -> None:
        self.work.wait()
        self.then()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=29_420_544)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    per_rank = run(worker, world_size=2, args=(args.numel, args.repeats), timeout=600)
    mib = args.numel * 4 / 2**20
    print(f"gloo, 2 ranks, buffer {args.numel:,} fp32 elements ({mib:.1f} MiB); median over "
          f"{args.repeats} repeats, slower rank")
    print(f"{'collective':<26} {'issue ms':>9} {'wait ms':>9} {'total ms':>9} {'CPU ms':>9}")
    for name in per_rank[0]:
        rows = [max(a, b, key=lambda r: r[0] + r[1]) for a, b in zip(per_rank[0][name], per_rank[1][name])]
        med = [sorted(col)[len(col) // 2] * 1e3 for col in
               ([r[0] for r in rows], [r[1] for r in rows], [r[0] + r[1] for r in rows], [r[2] for r in rows])]
        print(f"{name:<26} " + " ".join(f"{v:>9.1f}" for v in med))


if __name__ == "__main__":
    main()
