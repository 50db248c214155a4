"""A DeepSpeed training script in the shape of DeepSpeed's getting-started tutorial, run
unchanged by DeepSpeed 0.19.8 and by fz3 (change its first import line, `import deepspeed`, to
`import fz3.deepspeed as deepspeed`).

    DS_ACCELERATOR=cpu bench/.env/bin/torchrun --nproc_per_node 2 examples/deepspeed_script.py \
        --deepspeed_config examples/deepspeed_config.json --out /tmp/ds_rows.json

The optimizer (AdamW) and the scheduler (WarmupDecayLR) come from the JSON config, with ZeRO
stage 3, gradient_accumulation_steps 2 and gradient_clipping 1.0. A tiny fixed-seed MLP
regresses fixed synthetic data; every micro-step logs the loss, `engine.get_lr()`, the
counters and `is_gradient_accumulation_boundary()` before forward, after backward and after
step. After 8 micro-steps (4 optimizer steps) the engine saves a checkpoint with client
state, loads it back and trains one more window. `--out` writes the rows as JSON from rank
0; DeepSpeed's own run is recorded in tests/data/deepspeed_script_0.19.8.json
(bench/deepspeed_records/deepspeed_script.sh).
"""
import deepspeed
import argparse
import json
import os

import torch
import torch.distributed as dist

IN, HIDDEN, OUT = 8, 32, 4
TRAIN_MICRO_STEPS, RESUMED_MICRO_STEPS = 8, 2


class MLP(torch.nn.Module):
    """x (B, 8) -> (B, 4); forward returns the mean squared error against y."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(IN, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.fc1(x))   # (B, 32)
        h = torch.nn.functional.gelu(self.fc2(h))   # (B, 32)
        return torch.nn.functional.mse_loss(self.head(h), y)


def synthetic_data(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rows on every rank: x (rows, 8) standard normal, y = 3 sin(x @ W) (rows, 4)."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(rows, IN, generator=g)
    w = torch.randn(IN, OUT, generator=g)
    return x, 3.0 * torch.sin(x @ w)


def micro_batch(data, step: int, rank: int, world: int, micro: int):
    """Global micro-step `step` covers rows [step*world*micro, (step+1)*world*micro); this rank
    takes its own `micro` of them."""
    start = (step * world + rank) * micro
    return data[0][start:start + micro], data[1][start:start + micro]


def counters(engine) -> dict:
    return {"lr": engine.get_lr(), "global_steps": engine.global_steps,
            "global_samples": engine.global_samples, "micro_steps": engine.micro_steps,
            "boundary": engine.is_gradient_accumulation_boundary(),
            "was_step_applied": engine.was_step_applied()}


def mean_over_ranks(value: torch.Tensor) -> float:
    t = value.detach().clone().reshape(1)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def train(engine, data, steps, first: int, phase: str, rows: list) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    micro = engine.train_micro_batch_size_per_gpu()
    for i in range(first, first + steps):
        x, y = micro_batch(data, i, rank, world, micro)
        before = engine.is_gradient_accumulation_boundary()
        loss = engine(x, y)
        engine.backward(loss)
        after_backward = engine.is_gradient_accumulation_boundary()
        engine.step()
        row = {"phase": phase, "micro_step": i, "loss": loss.item(), "loss_mean": mean_over_ranks(loss),
               "boundary_before_forward": before, "boundary_after_backward": after_backward,
               "boundary_after_step": engine.is_gradient_accumulation_boundary(),
               "was_step_applied": engine.was_step_applied(), "lr": engine.get_lr(),
               "global_steps": engine.global_steps, "global_samples": engine.global_samples,
               "micro_steps": engine.micro_steps,
               "grad_norm": float(engine.get_global_grad_norm()) if engine.was_step_applied() else None}
        rows.append(row)
        if rank == 0:
            print(f"micro {i} loss {row['loss_mean']:.6f} lr {row['lr']} steps {row['global_steps']} "
                  f"samples {row['global_samples']} applied {row['was_step_applied']}", flush=True)


def final_params(engine) -> dict:
    """name -> [sum, norm] of each gathered parameter (float64), the same on every rank."""
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        return {n: [p.double().sum().item(), p.double().norm().item()]
                for n, p in engine.module.named_parameters()}


def main() -> None:
    parser = argparse.ArgumentParser(description="DeepSpeed tutorial-shaped script (fz3 drop-in check)")
    parser.add_argument("--local_rank", type=int, default=-1, help="passed by the deepspeed launcher")
    parser.add_argument("--out", default=None, help="write the logged rows as JSON (rank 0)")
    parser.add_argument("--save_dir", default="/tmp/deepspeed_script_ckpt")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = MLP()
    engine, optimizer, _, lr_scheduler = deepspeed.initialize(args=args, model=model,
                                                              model_parameters=model.parameters())
    world = dist.get_world_size()
    rows_needed = (TRAIN_MICRO_STEPS + RESUMED_MICRO_STEPS) * world * engine.train_micro_batch_size_per_gpu()
    data = synthetic_data(rows_needed)
    record = {"deepspeed_version": getattr(deepspeed, "__version__", None), "world_size": world,
              "config": json.load(open(args.deepspeed_config)),
              "optimizer": type(optimizer).__name__, "lr_scheduler": type(lr_scheduler).__name__,
              "train_batch_size": engine.train_batch_size(),
              "train_micro_batch_size_per_gpu": engine.train_micro_batch_size_per_gpu(),
              "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
              "before_training": counters(engine), "rows": []}

    train(engine, data, TRAIN_MICRO_STEPS, 0, "train", record["rows"])
    record["params_after_train"] = final_params(engine)

    saved = engine.save_checkpoint(args.save_dir, client_state={"epoch": 1, "note": "after 4 steps"})
    record["save_checkpoint_returned"] = saved
    path, client_state = engine.load_checkpoint(args.save_dir)
    record["load_checkpoint"] = {"path": os.path.relpath(path, args.save_dir) if path else None,
                                 "client_state": {k: client_state[k] for k in ("epoch", "note")},
                                 "after": counters(engine)}
    record["params_after_load"] = final_params(engine)

    train(engine, data, RESUMED_MICRO_STEPS, TRAIN_MICRO_STEPS, "resumed", record["rows"])
    record["params_final"] = final_params(engine)

    if dist.get_rank() == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
        print(f"wrote {args.out}", flush=True)
    # torch 2.13 + gloo can abort a rank during interpreter shutdown (docs/environment.md): end cleanly
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
