"""fz3.hf.Trainer: a transformers.Trainer that trains through fz3 (ZeRO-3). A tiny Llama built
from a LlamaConfig (no download) learns fixed Markov sequences on 2 local CPU ranks, in steps:

    pip install -e '.[hf]'                                # transformers, accelerate
    python examples/train_hf_trainer.py                   # spawns 2 gloo ranks itself
    python examples/train_hf_trainer.py --world-size 4 --steps 40
    torchrun --nproc_per_node 2 examples/train_hf_trainer.py      # steps 1-3 only

  1. train    fz3.hf.Trainer(..., fz3_config=DS_CONFIG): a DeepSpeed dict whose "auto" values
              the Trainer fills from TrainingArguments (batch sizes, gradient_clipping, bucket
              sizes from hidden_size), as transformers does for DeepSpeed; the Trainer's own
              AdamW, warmup + cosine schedule, gradient accumulation, clipping and logging;
              a sharded fz3 checkpoint in output_dir/checkpoint-N every --save-steps
  2. save     trainer.save_model(final) on every rank (rank 0 writes the gathered weights);
              LlamaForCausalLM.from_pretrained(final) loads them: equal to the engine's
  3. resume   a new model and Trainer, train(resume_from_checkpoint=checkpoint-N): the losses
              it logs after step N equal the first run's, bit for bit
  4. compare  the plain transformers.Trainer on one process, the same global batch: its
              logged losses beside fz3's (exit status 1 past the tolerance)

Each step prints what it shows. Under torchrun every process is a rank, so step 4 (one process,
no ranks) is left out there.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

import fz3.launch
from gpt import markov_batch

try:
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments
    from transformers import Trainer as PlainTrainer
    from transformers.utils import logging as hf_logging
    import fz3.hf
except ImportError:  # the `hf` extra is not installed
    sys.exit("examples/train_hf_trainer.py needs transformers and accelerate: pip install -e '.[hf]'")

VOCAB, HIDDEN, SEQ = 128, 64, 32
MICRO, GAS = 4, 2  # per-rank micro batch, gradient accumulation steps
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto"},
}


def make_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ, use_cache=False,
        tie_word_embeddings=False, attn_implementation="eager"))  # plain matmuls: the same sums


def make_data(samples: int) -> list[dict[str, torch.Tensor]]:
    x, _ = markov_batch(0, batch=samples, seq=SEQ, vocab=VOCAB)  # the model shifts the labels
    return [{"input_ids": row, "labels": row} for row in x]


def make_args(output_dir: str, micro: int, args: argparse.Namespace) -> TrainingArguments:
    return TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=micro, gradient_accumulation_steps=GAS,
        max_steps=args.steps, learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=2,
        max_grad_norm=1.0, logging_steps=args.log_every, save_strategy="steps", save_steps=args.save_steps,
        report_to="none", disable_tqdm=True, seed=0, use_cpu=True)


def losses(trainer, after: int = 0) -> list[tuple[int, float]]:
    return [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h and h["step"] > after]


def sharded(rank: int, world: int, args: argparse.Namespace) -> list[tuple[int, float]]:
    """Steps 1-3 on one rank; -> the losses step 1 logged."""
    say = print if rank == 0 else (lambda *a, **k: None)
    hf_logging.disable_progress_bar()  # its bars' lock outlives a rank ending in os._exit
    samples = world * MICRO * GAS * args.steps
    say(f"1. train: fz3.hf.Trainer on {world} ranks, {args.steps} steps of {world * MICRO * GAS} samples")
    trainer = fz3.hf.Trainer(model=make_model(), args=make_args(f"{args.out}/run", MICRO, args),
                             train_dataset=make_data(samples), fz3_config=DS_CONFIG)
    trainer.train()
    cfg = trainer.engine.config
    say(f"   'auto' filled: gradient_accumulation_steps={cfg.gradient_accumulation_steps}, "
        f"gradient_clipping={cfg.gradient_clipping}, reduce_bucket_size={cfg.reduce_bucket_size}, "
        f"param_persistence_threshold={cfg.param_persistence_threshold}")
    first = losses(trainer)
    say(f"   logged losses: {', '.join(f'{loss:.4f}' for _, loss in first)}")

    trainer.save_model(f"{args.out}/final")
    full = trainer.engine.full_state_dict()
    if rank == 0:
        loaded = LlamaForCausalLM.from_pretrained(f"{args.out}/final").state_dict()
        same = sorted(loaded) == sorted(full) and all(torch.equal(loaded[k], full[k]) for k in full)
        say(f"2. save: from_pretrained({args.out}/final) equals the engine's weights: {same}")

    ckpt = f"{args.out}/run/checkpoint-{args.save_steps}"
    again = fz3.hf.Trainer(model=make_model(), args=make_args(f"{args.out}/resumed", MICRO, args),
                           train_dataset=make_data(samples), fz3_config=DS_CONFIG)
    again.train(resume_from_checkpoint=ckpt)
    later = [s for s in first if s[0] > args.save_steps]
    say(f"3. resume from {ckpt}: the losses logged after step {args.save_steps} equal the first "
        f"run's, bit for bit: {losses(again, after=args.save_steps) == later}")
    return first


def plain(args: argparse.Namespace, world: int) -> list[tuple[int, float]]:
    """Step 4: the plain transformers.Trainer, one process, micro batch world * MICRO."""
    trainer = PlainTrainer(model=make_model(), args=make_args(f"{args.out}/plain", world * MICRO, args),
                           train_dataset=make_data(world * MICRO * GAS * args.steps))
    trainer.train()
    return losses(trainer)


def main() -> int:
    ap = argparse.ArgumentParser(description="Train a tiny Llama with fz3.hf.Trainer on local ranks.")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--save-steps", type=int, default=10, help="a checkpoint every N steps")
    ap.add_argument("--log-every", type=int, default=2, help="logging_steps")
    ap.add_argument("--out", default=None, help="output folder (default: a new temporary one)")
    args = ap.parse_args()
    if not 0 < args.save_steps < args.steps:
        ap.error("--save-steps must be between 0 and --steps (step 3 resumes from that checkpoint)")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # else accelerate sets torch's threads from the cores
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        rank, world = fz3.launch.init_from_env()
        out = [args.out or (tempfile.mkdtemp(prefix="fz3_hf_trainer_") if rank == 0 else None)]
        torch.distributed.broadcast_object_list(out, src=0)  # one folder for every rank
        args.out = out[0]
        sharded(rank, world, args)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()  # before exit: see docs/environment.md (gloo, 2.13)
        return 0
    os.environ.setdefault("FZ3_DEVICE", "cpu")
    args.out = args.out or tempfile.mkdtemp(prefix="fz3_hf_trainer_")
    mine = fz3.launch.run(sharded, world_size=args.world_size, args=(args,), timeout=600)[0]
    hf_logging.disable_progress_bar()
    ref = plain(args, args.world_size)
    tol = 1e-4
    print(f"4. compare: transformers.Trainer on one process, global batch {args.world_size * MICRO * GAS}")
    print("   step   fz3 loss   plain loss   relative difference")
    worst = 0.0
    for (step, a), (_, b) in zip(mine, ref):
        rel = abs(a - b) / abs(b)
        worst = max(worst, rel)
        print(f"   {step:4d}   {a:8.5f}   {b:10.5f}   {rel:.1e}")
    if len(mine) != len(ref) or worst > tol:
        print(f"MISMATCH: fz3.hf.Trainer diverged from transformers.Trainer (tolerance {tol:.0e})")
        return 1
    print(f"OK: every logged loss within {worst:.1e} of transformers.Trainer's (tolerance {tol:.0e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
