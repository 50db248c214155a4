"""The static tables of a model: parameters, fetch units (modules), shard layout.

Built once by `build_spec` from plain names and numels (the shell reads them off an nn.Module;
tests generate them). Never changes afterwards, so every state shares it by reference.

Layout, as in DeepSpeed: shard = ceil(numel / W); the flat param is padded to shard * W and rank
r owns [r * shard, (r + 1) * shard). A rank may own padding only; numel 0 gives empty shards.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

from fz3.core.ids import ModuleId, ParamId


def shard_numel(numel: int, world_size: int) -> int:
    """Elements each rank keeps of a param of `numel` elements: ceil(numel / W)."""
    return -(-numel // world_size)


def padding(numel: int, world_size: int) -> int:
    """Zeros appended so the flat param splits evenly: (W - numel mod W) mod W."""
    return shard_numel(numel, world_size) * world_size - numel


class ParamSpec(NamedTuple):
    id: ParamId
    name: str  # qualified name, display only
    numel: int
    shard_numel: int
    persistent: bool  # stays gathered for the whole step (persistent_flags)


class ModuleSpec(NamedTuple):
    id: ModuleId
    name: str  # qualified name, display only
    params: tuple[ParamId, ...]  # the fetch unit: direct params (whole subtree for a leaf), sorted
    is_leaf: bool
    numel: int  # sum of its params' numel


@dataclass(frozen=True, eq=False)
class ModelSpec:
    params: tuple[ParamSpec, ...]
    modules: tuple[ModuleSpec, ...]
    world_size: int  # the ranks each param is split over (its layout: shard_numel)
    replicas: int = 1  # the copies of each shard: world_size x replicas ranks train, each grad is
    # averaged over all of them (stage 0: world_size 1, every rank a replica; fz3/core/stage.py)
    max_inflight: int = 2  # gathers in flight at once (Config.max_ongoing_fetch_events; param/state.py)
    secondary: int = 1  # hpZ's group: the ranks a secondary shard is split over (1: off; [Note:
    # hpZ], fz3/core/stage.py)

    @property
    def groups(self) -> int:
        """Hybrid sharding's groups, each holding every shard ([Note: hybrid sharding],
        fz3/core/stage.py): the replicas of a layout of several ranks; 1 for a layout of one rank
        (stage 0), whose reduces span every rank at once."""
        return self.replicas if self.world_size > 1 else 1

    @property
    def ranks(self) -> int:
        """Every rank that trains: the grads' mean is over this many."""
        return self.world_size * self.replicas

    def secondary_layout(self) -> "ModelSpec":
        """The same params laid out over the hpZ group's ranks: each secondary shard's size
        (shard_numel over `secondary` ranks), for the interpreters that gather them."""
        H = self.secondary
        return ModelSpec(tuple(p._replace(shard_numel=shard_numel(p.numel, H)) for p in self.params), self.modules,
                         H, 1, self.max_inflight)


def persistent_flags(numels: Sequence[int], persistence_threshold: int,
                     model_persistence_threshold: Optional[int] = None) -> tuple[bool, ...]:
    """Which params stay gathered all step: numel <= persistence_threshold, taken greedily in
    param order while their total stays <= model_persistence_threshold (None: no cap).

    A param that would overflow the cap is skipped and a later, smaller one may still fit.
    DeepSpeed: `DeepSpeedZeRoOffload.mark_persistent_parameters` (named_parameters order, which
    is ParamId order).
    """
    flags, total = [], 0
    for numel in numels:
        fits = model_persistence_threshold is None or total + numel <= model_persistence_threshold
        keep = fits and numel <= persistence_threshold
        total += numel if keep else 0
        flags.append(keep)
    return tuple(flags)


def build_spec(params: Sequence[tuple[str, int]], modules: Sequence[tuple[str, Sequence[int], bool]],
               *, world_size: int, persistence_threshold: int,
               model_persistence_threshold: Optional[int] = None, replicas: int = 1,
               max_inflight: int = 2, secondary: int = 1) -> ModelSpec:
    """params: (name, numel) per ParamId; modules: (name, param ids, is_leaf) per ModuleId.

    A param may belong to several modules (tied weights appear once, with one id). Persistence:
    `persistent_flags`.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    for name, numel in params:
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise ValueError(f"param {name!r} has numel {numel!r}; expected an int >= 0")
    persistent = persistent_flags([n for _, n in params], persistence_threshold,
                                  model_persistence_threshold)
    pspecs = [ParamSpec(ParamId(i), name, numel, shard_numel(numel, world_size), keep)
              for i, ((name, numel), keep) in enumerate(zip(params, persistent))]
    mspecs = []
    for i, (name, pids, is_leaf) in enumerate(modules):
        ids = tuple(sorted(set(pids)))
        for p in ids:
            if not 0 <= p < len(pspecs):
                raise ValueError(f"module {name!r} names param id {p}; ids run 0..{len(pspecs) - 1}")
        mspecs.append(ModuleSpec(ModuleId(i), name, tuple(ParamId(p) for p in ids), bool(is_leaf),
                                 sum(pspecs[p].numel for p in ids)))
    if world_size % secondary:
        raise ValueError(f"secondary={secondary} (hpZ's group) must divide world_size={world_size}")
    return ModelSpec(tuple(pspecs), tuple(mspecs), world_size, replicas, max_inflight, secondary)
