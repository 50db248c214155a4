"""Cost of fz3's data-plane packing on one rank, without communication (issue #5 diagnosis).

    python bench/copy_costs.py [--model wide|small] [--repeat 5]

For every param of the model (W = 2), times what DistInterpreter does around its collectives:
pack_gather (cat of shards), unpack_gather (column split + per-param reshape copy),
pack_reduce_scatter (F.pad per grad + cat), CopyToBucket (grad -> flat bucket) — and, for each,
a variant that writes into a buffer allocated once and reused (what a buffer pool would do),
to separate the copying from fresh-allocation page faults. One thread, like the benchmark ranks.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import os

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fz3.data import collectives  # noqa: E402
from fz3.core.spec import shard_numel  # noqa: E402
from systems.common import make_model  # noqa: E402


def timeit(fn, repeat: int) -> float:
    fn()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="wide")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    W = 2
    params = list(dict.fromkeys(make_model(args.model).parameters()))
    numels = [p.numel() for p in params]
    shards = [torch.randn(shard_numel(n, W)) for n in numels]
    grads = [torch.randn(p.shape) for p in params]
    S = sum(s.numel() for s in shards)
    gathered = torch.randn(W * S)
    out_cat = torch.empty(S)
    flat_full = torch.empty(sum(shard_numel(n, W) * W for n in numels))
    rs_in = torch.empty(W * S)
    bucket = torch.empty(sum(numels))
    widths = [s.numel() for s in shards]
    mib = 4 * sum(numels) / 2**20

    def unpack_pooled():
        cols = torch.split(gathered.view(W, -1), widths, dim=1)
        off = 0
        for c, w in zip(cols, widths):
            flat_full[off:off + W * w].view(W, w).copy_(c)
            off += W * w

    def rs_pooled():
        v = rs_in.view(W, -1)
        off = 0
        for g, w in zip(grads, widths):
            n = g.numel()
            if n == W * w:  # no padding: one strided copy, no temporary
                v[:, off:off + w].copy_(g.view(W, w))
            else:
                v[:, off:off + w].copy_(torch.nn.functional.pad(g.reshape(-1), (0, W * w - n)).view(W, w))
            off += w

    def bucket_copy():
        off = 0
        for g in grads:
            bucket[off:off + g.numel()].copy_(g.reshape(-1))
            off += g.numel()

    rows = [
        ("pack_gather (torch.cat of shards, fresh)", lambda: collectives.pack_gather(shards)),
        ("  same into a reused buffer (cat out=)", lambda: torch.cat(shards, out=out_cat)),
        ("unpack_gather (split + reshape copies, fresh)", lambda: collectives.unpack_gather(gathered, numels, W)),
        ("  same into one reused flat buffer", unpack_pooled),
        ("pack_reduce_scatter (pad + cat, fresh)", lambda: collectives.pack_reduce_scatter(grads, W)),
        ("  same, one strided copy per grad into a reused buffer", rs_pooled),
        ("CopyToBucket for every grad (pooled bucket)", bucket_copy),
        ("torch.empty + fill of the full-model size (page faults)", lambda: torch.empty(W * S).fill_(0)),
    ]
    print(f"{args.model}: {sum(numels):,} params ({mib:.0f} MiB fp32), {len(params)} tensors, W={W}, 1 thread")
    print(f"{'operation':58s} {'ms':>8s} {'GB/s':>6s}")
    for name, fn in rows:
        t = timeit(fn, args.repeat)
        print(f"{name:58s} {1e3 * t:8.1f} {mib * 2**20 / 1e9 / t:6.2f}")


if __name__ == "__main__":
    main()
