"""FSDP2: fully_shard on each block, then the root (wte / lm_head tied in the root group), CPU
mesh, SUM reduction (set_force_sum_reduction_for_comms) with FSDP's own division by the world
size afterwards: gloo's AVG is unreliable (pytorch#162338)."""
from __future__ import annotations

from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from systems.common import loss_fn, make_model, make_optimizer, optimizer_state_tensors


class Fsdp2:
    def __init__(self, spec: dict, world: int) -> None:
        self.model = make_model(spec["model"])
        mesh = init_device_mesh("cpu", (world,))
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        for m in self.model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
        self.opt = make_optimizer(self.model.parameters())

    def step(self, x, y) -> float:
        self.opt.zero_grad()  # first, so the last step's grads are still there to be counted
        loss = loss_fn(self.model(x), y)
        loss.backward()
        self.opt.step()
        return loss.item()

    def memory(self) -> dict[str, list]:
        ps = list(self.model.parameters())
        return {"params": ps, "grads": [p.grad for p in ps], "optimizer": optimizer_state_tensors(self.opt)}


def build(rank: int, world: int, spec: dict) -> Fsdp2:
    return Fsdp2(spec, world)
