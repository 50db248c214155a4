"""Step 4: the real engine, N ranks in one process.

Steps 1-3 ran the pure core and a simulated world below the engine. Here the whole of fz3 runs:
fz3.initialize, the module hooks, the core, the real interpreter with its point-to-point
all-gathers and reduce-scatters, the divergence check, the sharded AdamW step. Only the ranks
are different: threads of this process (fz3.launch.run_threads), whose messages are handed
over in memory instead of through gloo. The ranks take turns, so every run is the same.

The same `train` function runs on 3 thread ranks and, for comparison, in plain single-process
PyTorch on the whole batch. Watch:

  - each rank holds a third of every param (its shard) and of the optimizer state;
  - each step, every rank gathers, computes its own slice of the batch, reduces, and steps;
  - the losses and the final weights match single-process training (up to the order in which
    fp32 sums are added);
  - engine.stats() counts what moved, as on real ranks.

    python examples/04_simulated_engine.py
"""
import torch
from torch import nn

import fz3
from fz3 import launch

W, STEPS, BATCH = 3, 4, 12


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """One fixed batch of BATCH samples (the loss falls as the model fits it)."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 4, generator=g)


def train(rank: int, world_size: int) -> dict:
    model = build()
    engine = fz3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                            fz3.Config(param_persistence_threshold=0, reduce_bucket_size=2000))
    per = BATCH // world_size
    losses = []
    for step in range(STEPS):
        x, y = batch()
        loss = nn.functional.mse_loss(engine(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    shard = {name: tuple(engine.store.shards[p].shape) for p, name in enumerate(engine.tables.names)}
    return {"losses": losses, "state": engine.full_state_dict(), "stats": engine.stats(), "shards": shard}


def reference() -> tuple[list[float], dict]:
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    per, losses = BATCH // W, []
    for step in range(STEPS):
        x, y = batch()
        opt.zero_grad()
        rank_losses = [nn.functional.mse_loss(model(x[r * per:(r + 1) * per]), y[r * per:(r + 1) * per])
                       for r in range(W)]
        (sum(rank_losses) / W).backward()  # fz3 averages the grads over ranks
        opt.step()
        losses.append([l.item() for l in rank_losses])
    return losses, model.state_dict()


if __name__ == "__main__":
    ranks = launch.run_threads(train, W)
    ref_losses, ref_state = reference()
    print(f"{W} ranks as threads of one process; each holds a shard of every param:")
    for name, shape in ranks[0]["shards"].items():
        print(f"  {name:10s} full {tuple(ref_state[name].shape)!s:9s} -> shard of {shape[0]} elements per rank")
    print("\nloss per step (rank 0 / 1 / 2, each on its own third of the batch), fz3 vs single process:")
    for step in range(STEPS):
        fz = " / ".join(f"{ranks[r]['losses'][step]:.5f}" for r in range(W))
        ref = " / ".join(f"{v:.5f}" for v in ref_losses[step])
        print(f"  step {step + 1}: {fz}   reference {ref}")
    worst = max((ranks[0]["state"][k] - ref_state[k]).abs().max().item() for k in ref_state)
    print(f"\nlargest difference of a weight after {STEPS} steps: {worst:.2e}")
    stats = ranks[0]["stats"]
    print(f"rank 0 moved: {stats['all_gather']} all-gathers ({stats['gathered_bytes']:,} B), "
          f"{stats['reduce']} reduces ({stats['reduced_bytes']:,} B)")
    ok = worst < 1e-5 and all(abs(a - b) < 1e-5 for r in range(W) for a, b in
                              zip([s[r] for s in ref_losses], ranks[r]["losses"]))
    print(f"matches single-process training: {ok}")
