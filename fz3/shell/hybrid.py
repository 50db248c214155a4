"""FSDP2's form of hybrid sharding: a 2-D DeviceMesh, read as fz3's shard_group_size.

    from_mesh(mesh, config, world_size) -> S

FSDP2's HSDP takes a mesh of shape (replicate, shard): dim 0 the groups that hold the same
shards, dim 1 the ranks one param is split over. fz3's groups are consecutive ranks (group g:
ranks g*S .. g*S + S - 1; [Note: hybrid sharding], fz3/core/stage.py), which is the mesh
`init_device_mesh(device, (R, S))` builds: its ranks in row-major order.
"""
from __future__ import annotations


def from_mesh(mesh, config, world_size: int) -> int:
    """The shard group size `mesh` says; a clear error for a mesh fz3 cannot run."""
    shape = tuple(getattr(mesh, "shape", ()))
    if len(shape) != 2:
        raise ValueError(f"fz3.initialize(mesh=...): hybrid sharding takes a 2-D DeviceMesh of shape (replicate, "
                         f"shard), as FSDP2's HSDP does; got a mesh of shape {shape}")
    R, S = shape
    if R * S != world_size:
        raise ValueError(f"fz3.initialize(mesh=...): the mesh's {R} x {S} = {R * S} ranks are not the world's "
                         f"{world_size}: build it over every rank, init_device_mesh(device, ({R}, {world_size // R}))"
                         if world_size % R == 0 else
                         f"fz3.initialize(mesh=...): the mesh's {R} x {S} = {R * S} ranks are not the world's "
                         f"{world_size}: build it over every rank")
    ranks = [int(r) for r in mesh.mesh.reshape(-1).tolist()]
    if ranks != list(range(world_size)):
        raise ValueError(f"fz3.initialize(mesh=...): fz3 shards within groups of consecutive ranks (group g: ranks "
                         f"g*{S} .. g*{S}+{S - 1}); this mesh lists its ranks as {ranks}, so build it as "
                         f"init_device_mesh(device, ({R}, {S}))")
    if config.shard_group_size not in (0, S):
        raise ValueError(f"fz3.initialize(mesh=...): the mesh shards over {S} ranks but "
                         f"Config.shard_group_size={config.shard_group_size}; give one of them")
    return S
