"""The main job: train a small GPT with fz3 on 2 local CPU ranks, then check it against plain
single-process training of the same model on the same data.

    python examples/train_gpt.py                        # spawns 2 gloo ranks itself
    python examples/train_gpt.py --world-size 3 --steps 60 --bf16
    torchrun --nproc_per_node 2 examples/train_gpt.py   # or under torchrun

Each rank holds 1/N of every parameter, gradient and optimizer state; the progress bar shows
the loss, the step time and the live full-parameter memory (what is gathered right now). The
run ends by training the same model without sharding and comparing the final losses.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import fz3
import fz3.launch
from gpt import GPT, GPTConfig, loss_fn, markov_batch

MODEL = GPTConfig(vocab=256, d_model=64, n_head=4, n_layer=2, seq=32)


def make_model() -> GPT:
    torch.manual_seed(0)
    return GPT(MODEL)


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)


def bar(step: int, steps: int, loss: float, ms: float, live_bytes: int) -> str:
    done = int(24 * step / steps)
    return (f"\rstep {step:3d}/{steps} |{'#' * done}{'.' * (24 - done)}| loss {loss:6.3f} "
            f"| {ms:6.1f} ms/step | live params {live_bytes / 2**10:7.1f} KiB")


def train(rank: int, world: int, args: argparse.Namespace) -> list[float]:
    """One rank of the sharded run; -> the global mean loss per step (on every rank)."""
    cfg = fz3.Config(param_persistence_threshold=MODEL.d_model, max_live_parameters=args.max_live,
                     max_reuse_distance=args.max_live // 4,
                     compute_dtype="bf16" if args.bf16 else "fp32")
    model = make_model()
    engine = fz3.initialize(model, make_optimizer(model.parameters()), cfg)
    per_rank = args.batch // world
    losses = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        x, y = markov_batch(step, batch=args.batch, seq=MODEL.seq, vocab=MODEL.vocab)
        x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        loss = loss_fn(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / world)
        if rank == 0:
            live = engine.stats()["peak_live_numel"] * (2 if args.bf16 else 4)
            print(bar(step + 1, args.steps, losses[-1], 1e3 * (time.perf_counter() - t0), live),
                  end="", flush=True)
    if rank == 0:
        s = engine.stats()
        print(f"\nrank 0 holds {s['param_shards'] + s['grad_partitions']} bytes of params + grads; "
              f"{s['all_gather']} all-gathers ({s['all_gather_prefetch']} prefetched), "
              f"trace {s['trace']}")
    return losses


def reference(args: argparse.Namespace) -> list[float]:
    """The same model, optimizer and data, in one process without sharding."""
    model = make_model()
    opt = make_optimizer(model.parameters())
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    losses = []
    for step in range(args.steps):
        x, y = markov_batch(step, batch=args.batch, seq=MODEL.seq, vocab=MODEL.vocab)
        with torch.autocast("cpu", dtype=dtype, enabled=args.bf16):
            loss = loss_fn(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def main() -> int:
    ap = argparse.ArgumentParser(description="Train a small GPT with fz3 (ZeRO-3) on local ranks.")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=8, help="global batch (split over ranks)")
    ap.add_argument("--max-live", type=int, default=60_000, help="max_live_parameters")
    ap.add_argument("--bf16", action="store_true", help="bf16 compute, fp32 master shards")
    args = ap.parse_args()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        rank, world = fz3.launch.init_from_env()
        losses = train(rank, world, args)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()  # before exit: see docs/environment.md (gloo, 2.13)
        if rank != 0:
            return 0
    else:
        if args.batch % args.world_size:
            ap.error(f"--batch {args.batch} must divide by --world-size {args.world_size}")
        losses = fz3.launch.run(train, world_size=args.world_size, args=(args,), timeout=600)[0]
    ref = reference(args)
    tol = 5e-2 if args.bf16 else 1e-4
    rel = abs(losses[-1] - ref[-1]) / abs(ref[-1])
    print(f"final loss: fz3 {losses[-1]:.6f}  single process {ref[-1]:.6f}  "
          f"(first {losses[0]:.3f}; relative difference {rel:.1e}, tolerance {tol:.0e})")
    if rel > tol:
        print("MISMATCH: sharded training diverged from the single-process reference")
        return 1
    print("OK: matches single-process training")
    return 0


if __name__ == "__main__":
    sys.exit(main())
