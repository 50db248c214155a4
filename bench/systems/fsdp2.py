"""FSDP2: fully_shard on each block, then the root (wte / lm_head tied in the root group), CPU
mesh, SUM reduction (set_force_sum_reduction_for_comms) with FSDP's own division by the world
size afterwards: gloo's AVG is unreliable (pytorch#162338)."""
from __future__ import annotations

from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from systems.common import Plain, device, make_model


class Fsdp2(Plain):
    """The plain loop over a fully_shard-ed model (its optimizer built after sharding)."""

    def __init__(self, spec: dict, world: int) -> None:
        model = make_model(spec["model"])
        shard(model, world)
        super().__init__(model, model, foreach=spec.get("options", {}).get("foreach"))


def shard(model, world: int) -> None:
    """fully_shard each block, then the root, on a CPU mesh; SUM reduction (FSDP divides after)."""
    mesh = init_device_mesh(device().type, (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)


def build(rank: int, world: int, spec: dict) -> Fsdp2:
    return Fsdp2(spec, world)
