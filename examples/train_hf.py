"""A Hugging Face model under fz3: a small Llama built from a `transformers` config (no
download), trained with ZeRO-3 on 2 local CPU ranks, then checked against plain single-process
training of the same model on the same data.

    pip install -e '.[hf]'                                   # transformers + safetensors
    python examples/train_hf.py                              # spawns 2 gloo ranks itself
    python examples/train_hf.py --world-size 4 --steps 40 --gradient-checkpointing
    python examples/train_hf.py --gradient-checkpointing --reentrant
    torchrun --nproc_per_node 2 examples/train_hf.py         # or under torchrun

The model is LlamaForCausalLM (untied lm_head) from a tiny LlamaConfig with a fixed seed; the
data is a fixed random Markov chain over the vocabulary (examples/gpt.py markov_batch), made
locally, no tokenizer. The loss is the model's own: `engine(input_ids=x, labels=x).loss`, a
field of the CausalLMOutputWithPast the root returns. `--gradient-checkpointing` calls HF's
`model.gradient_checkpointing_enable()` (transformers 5.x: use_reentrant=False unless
`--reentrant`) on both runs. The progress bar is tqdm's when tqdm is installed, a plain one
otherwise. Exit status 1 if the final losses differ by more than the tolerance.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import torch

import fz3
import fz3.launch
from gpt import markov_batch

try:
    from transformers import LlamaConfig, LlamaForCausalLM
except ImportError:  # the `hf` extra is not installed
    sys.exit("examples/train_hf.py needs transformers: pip install -e '.[hf]'")

VOCAB, HIDDEN, SEQ = 256, 64, 32


def make_model(args: argparse.Namespace) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=SEQ, tie_word_embeddings=False, use_cache=False,
                         attn_implementation="eager")  # plain matmuls: the same sums on every run
    model = LlamaForCausalLM(config)
    if args.gradient_checkpointing:
        with warnings.catch_warnings():  # 5.x: "deprecated: use activation_checkpointing_enable"
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": True} if args.reentrant else None)
    return model


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)


class Bar:
    """tqdm if installed, else a one-line bar on stderr like examples/train_gpt.py's."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        try:
            import threading
            from tqdm import tqdm
            # a thread lock: tqdm's default also makes a multiprocessing semaphore, which a rank
            # ending in os._exit (fz3.launch) leaves behind ("leaked semaphore" at exit)
            tqdm.set_lock(threading.RLock())
            self.tqdm = tqdm(total=steps, desc="fz3", unit="step", file=sys.stderr)
        except ImportError:
            self.tqdm = None

    def update(self, step: int, loss: float, ms: float, live_kib: float) -> None:
        if self.tqdm is not None:
            self.tqdm.set_postfix_str(
                f"loss {loss:6.3f} | {ms:5.1f} ms | live params {live_kib:.0f} KiB", refresh=False)
            self.tqdm.update(1)
            return
        done = int(24 * step / self.steps)
        print(f"\rstep {step:3d}/{self.steps} |{'#' * done}{'.' * (24 - done)}| loss {loss:6.3f} "
              f"| {ms:6.1f} ms/step | live params {live_kib:7.1f} KiB",
              end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.tqdm is not None:
            self.tqdm.close()
        else:
            print(file=sys.stderr)


def train(rank: int, world: int, args: argparse.Namespace) -> list[float]:
    """One rank of the sharded run; -> the global mean loss per step (on every rank)."""
    cfg = fz3.Config(param_persistence_threshold=HIDDEN,  # norm weights stay whole on every rank
                     max_live_parameters=args.max_live, max_reuse_distance=args.max_live // 4)
    model = make_model(args)
    engine = fz3.initialize(model, make_optimizer(model.parameters()), cfg)
    per_rank = args.batch // world
    bar = Bar(args.steps) if rank == 0 else None
    losses = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        x, _ = markov_batch(step, batch=args.batch, seq=SEQ, vocab=VOCAB)
        x = x[rank * per_rank:(rank + 1) * per_rank]  # (B / W, T): this rank's rows
        loss = engine(input_ids=x, labels=x).loss  # HF shifts the labels itself
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / world)
        if bar is not None:
            bar.update(step + 1, losses[-1], 1e3 * (time.perf_counter() - t0),
                       engine.stats()["peak_live_numel"] * 4 / 2**10)
    if bar is not None:
        bar.close()
        s = engine.stats()
        print(f"rank 0 holds {s['param_shards'] + s['grad_partitions']} bytes of params + grads; "
              f"{s['all_gather']} all-gathers ({s['all_gather_prefetch']} prefetched), "
              f"trace {s['trace']}")
    return losses


def reference(args: argparse.Namespace) -> list[float]:
    """The same model, optimizer and data, in one process without sharding. Each rank's loss is
    the mean over its rows' tokens, the same count on every rank, so their mean is this one."""
    model = make_model(args)
    opt = make_optimizer(model.parameters())
    losses = []
    for step in range(args.steps):
        x, _ = markov_batch(step, batch=args.batch, seq=SEQ, vocab=VOCAB)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def main() -> int:
    ap = argparse.ArgumentParser(
        description="Train a small Hugging Face Llama with fz3 (ZeRO-3) on local ranks.")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8, help="global batch (split over ranks)")
    ap.add_argument("--max-live", type=int, default=60_000, help="max_live_parameters")
    ap.add_argument("--gradient-checkpointing", action="store_true",
                    help="model.gradient_checkpointing_enable() before fz3.initialize")
    ap.add_argument("--reentrant", action="store_true",
                    help="with --gradient-checkpointing: use_reentrant=True (default False)")
    args = ap.parse_args()
    if args.reentrant and not args.gradient_checkpointing:
        ap.error("--reentrant only applies with --gradient-checkpointing")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        rank, world = fz3.launch.init_from_env()
        if args.batch % world:
            raise SystemExit(f"--batch {args.batch} must divide by the world size {world}")
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
    tol = 1e-4
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
