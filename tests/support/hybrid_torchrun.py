"""A training script for torchrun across 2 "nodes" of 2 ranks on one host
(tests/test_hybrid_sharding.py): hybrid sharding with its groups taken from the launch, one
group per node (shard_group_size = LOCAL_WORLD_SIZE). Writes each rank's losses and rank 0's
consolidated weights to OUT_DIR/rank{r}.pt."""
import os
import sys

import torch
from torch import nn

import fz3
import fz3.launch

STEPS, BATCH = 3, 8


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 2, generator=g)


def main(out_dir: str) -> None:
    rank, world = fz3.launch.init_from_env()
    net = model()
    engine = fz3.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                            fz3.Config(param_persistence_threshold=0, gradient_clipping=1.0,
                                       shard_group_size=int(os.environ["LOCAL_WORLD_SIZE"])))
    per, losses = BATCH // world, []
    for i in range(STEPS):
        x, y = batch(i)
        loss = (engine(x[rank * per:(rank + 1) * per]) - y[rank * per:(rank + 1) * per]).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state = engine.full_state_dict()
    stats = {k: engine.stats()[k] for k in ("bytes_intra_group", "bytes_inter_group", "reduce_across")}
    torch.save({"losses": losses, "state": state, "stats": stats, "shard": (engine.shard_rank, engine.shard_world)},
               os.path.join(out_dir, f"rank{rank}.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
