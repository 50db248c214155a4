"""The simulated world: N ranks in one process, executing the core's effects on real tensors.

    world = SimulatedWorld(spec, config=cfg, shards=..., grad_dtypes=...)  # or .from_params
    world.accumulate_grad(p, [grad_r0, ..., grad_rW-1])      # autograd wrote param.grad
    world.run(effects)                                        # what a core transition returned
    world.full[r][p], world.partitions[r][p]                  # read results

Every rank runs every effect (the core is rank-agnostic, I6); collectives are the `sim_*`
functions of fz3.data.collectives, so a gather is the concatenation of all ranks' shards and a
reduce is a SUM over ranks. Under hybrid sharding (a spec with replicas: [Note: hybrid
sharding], fz3/core/stage.py) the ranks are R groups of the layout's S: a gather concatenates
its own group's shards, a reduce sums within each group, and a ReduceBucket with `across` then
sums each partition over the ranks holding it, one per group; `reduced_on` counts each param's
reduces on each axis. Under hpZ ([Note: hpZ], stage.py) a Free keeps each rank's secondary shard
of the params it names, and a gather of secondary shards concatenates those of the rank's hpZ
group (H consecutive ranks): it must give what a gather of the shards gives (a secondary shard
kept past new shards is stale: SimulationError); `secondary_gathers` counts them. The interpreter decides nothing: an effect that the store cannot
honour (waiting a handle never issued, reducing grads never placed, a slot past the bucket's
capacity) raises SimulationError, which is how tests catch a core that emits nonsense.

Per rank:  shards[p] (s,)  full[p] (n,) while AVAILABLE  grads[p] = param.grad not yet in a bucket
           bucket buffer per BucketId (flat, capacity reduce_bucket_size; a HoldGrad is staged
           there like a CopyToBucket)  partitions[p] (s,)
Grad partitions start as NaN, like DeepSpeed's uninitialised flat buffer, and are NaN again after
FreePartitions (their memory given back): a core that adds where it should copy poisons them,
and the comparison with the naive model fails. Grads are reduced
in the effect's dtype, which must be the config's communication_data_type (else the grad's own:
checked here with a table of this file's own, so a core that ignores the config is caught), and
divided by the effect's predivide first; partitions keep their dtype (a write casts into it).
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable, Optional, Sequence

import torch

from fz3.config.config import Config
from fz3.core.effects import (AllGather, AverageGrads, ClearGrads, CopyToBucket, DropGrads, DropSecondary, Free,
                              FreePartitions, HoldGrad, ReduceBucket, Refresh, Wait, WaitReduce, WriteMode,
                              WritePartition, ZeroPartitions)
from fz3.core.ids import BucketId, Handle, ParamId
from fz3.core.spec import ModelSpec
from fz3.data import collectives, layout, partition


COMM = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # Config names


class SimulationError(RuntimeError):
    """An effect the simulated world cannot carry out; the message names it."""


class SimulatedWorld:
    """W ranks' tensors in one process; `run` applies effects to all of them."""

    def __init__(self, spec: ModelSpec, *, config: Config,
                 shards: Optional[Sequence[Sequence[torch.Tensor]]] = None,
                 dtype: torch.dtype = torch.float32,
                 grad_dtypes: Optional[Sequence[torch.dtype]] = None) -> None:
        # [Note: hybrid sharding]: the layout's S ranks in each of R groups (a layout of one rank,
        # stage 0, is one rank standing for all: its reduces span the world, as the engine's do)
        self.shard_world = spec.world_size
        self.groups = spec.groups
        self.spec, self.config, self.world_size = spec, config, self.shard_world * self.groups
        ranks = range(self.world_size)
        self.reduced_on: dict[str, Counter] = {"within": Counter(), "across": Counter()}  # param -> reduces
        if shards is None:
            shards = [[torch.zeros(p.shard_numel, dtype=dtype) for p in spec.params] for _ in ranks]
        self.shards: list[list[torch.Tensor]] = [list(s) for s in shards]
        self.full: list[dict[ParamId, torch.Tensor]] = [{} for _ in ranks]
        self.inflight: dict[Handle, list[dict[ParamId, torch.Tensor]]] = {}
        self.grads: list[dict[ParamId, torch.Tensor]] = [{} for _ in ranks]
        self.buckets: dict[BucketId, list[torch.Tensor]] = {}
        self.reduced: dict[BucketId, dict[ParamId, list[torch.Tensor]]] = {}
        gdt = list(grad_dtypes) if grad_dtypes is not None else [dtype] * len(spec.params)
        self.partitions: list[list[torch.Tensor]] = [
            [torch.full((p.shard_numel,), float("nan"), dtype=d) for p, d in zip(spec.params, gdt)]
            for _ in ranks]
        self.log: list[object] = []
        self.secondary: list[dict[ParamId, torch.Tensor]] = [{} for _ in ranks]  # hpZ, per rank
        self.secondary_gathers = 0

    @classmethod
    def from_params(cls, spec: ModelSpec, params: Sequence[torch.Tensor], *, config: Config
                    ) -> "SimulatedWorld":
        """Shard full params (one tensor per ParamId) over the spec's world size (each group
        holds the same shards)."""
        w = spec.world_size
        shards = [[layout.shard_of(t, r % w, w) for t in params] for r in range(w * spec.groups)]
        dtype = params[0].dtype if params else torch.float32
        return cls(spec, config=config, shards=shards, dtype=dtype)

    def accumulate_grad(self, param: ParamId, grads: Sequence[torch.Tensor]) -> None:
        """Autograd's AccumulateGrad on every rank (one tensor per rank), before bucket_add:
        param.grad = grad, or param.grad + grad if it still holds one."""
        if len(grads) != self.world_size:
            raise SimulationError(f"accumulate_grad({param}): {len(grads)} grads for "
                                  f"{self.world_size} ranks")
        for r, g in enumerate(grads):
            old = self.grads[r].get(param)
            self.grads[r][param] = g if old is None else old + g

    def run(self, effects: Iterable[object]) -> None:
        """Apply each effect, in order, on every rank."""
        for e in effects:
            self.log.append(e)
            match e:
                case AllGather(handle=h, params=ps, secondary=sec):
                    self._all_gather(h, ps, sec)
                case Wait(handle=h):
                    self._wait(h)
                case Free(params=ps, secondary=sec):
                    self._keep_secondary(sec)
                    self._free(ps)
                case DropSecondary(params=ps):
                    for kept in self.secondary:
                        for p in ps:
                            if kept.pop(p, None) is None:
                                raise SimulationError(f"DropSecondary of param {p}, which has no secondary shard")
                case Refresh(params=ps):
                    self._refresh(ps)
                case CopyToBucket() | HoldGrad():
                    self._copy_to_bucket(e)
                case ReduceBucket():
                    self._reduce(e)
                case WritePartition(bucket=b, param=p, mode=mode):
                    self._write(b, p, mode)
                case DropGrads(bucket=b, params=ps, contiguous=c):
                    self._drop(b, ps, c)
                case WaitReduce():
                    pass  # every collective here is synchronous
                case ZeroPartitions(params=ps):
                    for part in self.partitions:
                        for p in ps:
                            part[p] = torch.zeros_like(part[p])
                case AverageGrads(divisor=d):
                    self.partitions = [[partition.average(t, d) for t in part]
                                       for part in self.partitions]
                case ClearGrads(params=ps):  # param.grad = None on every rank
                    for g in self.grads:
                        for p in ps:
                            g.pop(p, None)
                case FreePartitions():  # memory given back: NaN again until written
                    self.partitions = [[torch.full_like(t, float("nan")) for t in part]
                                       for part in self.partitions]
                case _:
                    raise SimulationError(f"unknown effect {e!r}")

    # ---- parameter effects ------------------------------------------------------------------

    def _all_gather(self, handle: Handle, params: tuple[ParamId, ...], secondary: tuple[ParamId, ...] = ()) -> None:
        if handle in self.inflight:
            raise SimulationError(f"AllGather reuses handle {handle}, still in flight")
        for p in params:
            if p in self.full[0] or any(p in g[0] for g in self.inflight.values()):
                raise SimulationError(f"AllGather of param {p}, which is already gathered or "
                                      "in flight")
        if not set(secondary) <= set(params):
            raise SimulationError(f"AllGather of {params} names secondary shards of others: {secondary}")
        got = [dict(zip(params, out)) for out in self._gather(params)]
        if secondary:
            for r, out in enumerate(self._gather_secondary(secondary)):
                for p, t in zip(secondary, out):
                    if not torch.equal(t, got[r][p]):
                        raise SimulationError(f"rank {r}: param {p}'s secondary shards are stale (they differ "
                                              "from its shards)")
                    got[r][p] = t
            self.secondary_gathers += 1
        self.inflight[handle] = got

    def _gather_secondary(self, params: tuple[ParamId, ...]) -> list[list[torch.Tensor]]:
        """Every rank's full values of `params`, from the secondary shards of its hpZ group."""
        H = self.spec.secondary
        if H < 2:
            raise SimulationError(f"a gather of secondary shards of {params}, but hpZ is off")
        for r, kept in enumerate(self.secondary):
            for p in params:
                if p not in kept:
                    raise SimulationError(f"rank {r}: param {p} has no secondary shard to gather")
        numels = [self.spec.params[p].numel for p in params]
        return [out for g in range(self.world_size // H)
                for out in collectives.gather_world([[self.secondary[r][p] for p in params]
                                                     for r in range(g * H, (g + 1) * H)], numels)]

    def _keep_secondary(self, params: tuple[ParamId, ...]) -> None:
        """Each rank's secondary shard of `params`: piece r % H of its full value."""
        H = self.spec.secondary
        if params and H < 2:
            raise SimulationError(f"a Free keeps secondary shards of {params}, but hpZ is off")
        for r, (full, kept) in enumerate(zip(self.full, self.secondary)):
            for p in params:
                if p not in full:
                    raise SimulationError(f"rank {r}: a secondary shard of param {p}, which is not gathered")
                if p in kept:
                    raise SimulationError(f"rank {r}: param {p} keeps a second secondary shard")
                kept[p] = layout.shard_of(full[p], r % H, H)

    def _wait(self, handle: Handle) -> None:
        if handle not in self.inflight:
            raise SimulationError(f"Wait on handle {handle}, which is not in flight")
        for full, got in zip(self.full, self.inflight.pop(handle)):
            full.update(got)

    def _refresh(self, params: tuple[ParamId, ...]) -> None:
        """Gathered again from the shards, in place: each must be gathered already."""
        for p in params:
            if p not in self.full[0]:
                raise SimulationError(f"Refresh of param {p}, which is not gathered")
        for full, out in zip(self.full, self._gather(params)):
            full.update(zip(params, out))

    def _members(self) -> list[range]:
        """Each group's ranks: S consecutive ones."""
        S = self.shard_world
        return [range(g * S, (g + 1) * S) for g in range(self.groups)]

    def _gather(self, params: tuple[ParamId, ...]) -> list[list[torch.Tensor]]:
        """Every rank's full values of `params`, gathered from its own group's shards."""
        numels = [self.spec.params[p].numel for p in params]
        return [out for ranks in self._members()
                for out in collectives.gather_world([[self.shards[r][p] for p in params] for r in ranks], numels)]

    def _free(self, params: tuple[ParamId, ...]) -> None:
        for full in self.full:
            for p in params:
                if full.pop(p, None) is None:
                    raise SimulationError(f"Free of param {p}, which is not gathered")

    # ---- gradient effects -------------------------------------------------------------------

    def _copy_to_bucket(self, e: CopyToBucket | HoldGrad) -> None:
        """A held grad is staged like a copied one: the simulated collectives read values, and
        a value is the same wherever it lies (no carrier here reads a grad in place)."""
        if e.offset < 0 or e.offset + e.numel > self.config.reduce_bucket_size:
            raise SimulationError(f"{e}: slot outside the bucket's capacity "
                                  f"{self.config.reduce_bucket_size}")
        fresh = [torch.zeros(0) for _ in range(self.world_size)]
        buffers = self.buckets.setdefault(e.bucket, fresh)
        for r, grads in enumerate(self.grads):
            grad = self._grad(r, e.param, e.dtype).reshape(-1)
            if grad.numel() != e.numel:
                raise SimulationError(f"{e}: param.grad has {grad.numel()} elements")
            buf = buffers[r].to(grad.dtype)
            if buf.numel() < e.offset + e.numel:
                grow = e.offset + e.numel - buf.numel()
                buf = torch.cat([buf, torch.full((grow,), float("nan"), dtype=grad.dtype)])
            buf[e.offset:e.offset + e.numel] = grad  # the interpreter owns this buffer
            buffers[r] = buf
            del grads[e.param]  # param.grad is now a view of the bucket

    def _reduce(self, e: ReduceBucket) -> None:
        if e.bucket in self.reduced:
            raise SimulationError(f"bucket {e.bucket} reduced twice")
        inputs = [[g / e.predivide for g in self._slot_grads(r, e)]
                  for r in range(self.world_size)]  # [rank][slot]
        S = self.shard_world
        parts: list[list[torch.Tensor]] = []  # [rank][slot in `order`]
        for ranks in self._members():  # within each group ([Note: hybrid sharding])
            if e.path == "allreduce":
                end = max((s.offset + s.numel for s in e.slots), default=0)
                flats = [self.buckets[e.bucket][r][:end] / e.predivide if e.contiguous else
                         collectives.pack_bucket(inputs[r]) for r in ranks]
                outs = collectives.sim_all_reduce(flats)
                spans = [(s.offset, s.numel) for s in e.slots]
                parts += [collectives.slice_allreduced(o, spans, i, S) for i, o in enumerate(outs)]
                order = list(e.slots)
            else:
                order = sorted(e.slots, key=lambda s: s.param)
                idx = [e.slots.index(s) for s in order]
                packed = [collectives.pack_reduce_scatter([inputs[r][i] for i in idx], S) for r in ranks]
                outs = collectives.sim_reduce_scatter(packed)
                parts += [collectives.unpack_reduce_scatter(o, [s.numel for s in order], S) for o in outs]
        for s in order:
            self.reduced_on["within"][s.param] += 1
        if e.across > 1:  # then across the groups: the ranks holding the same shard, in rank order
            if e.across != self.groups:
                raise SimulationError(f"{e}: all-reduced across {e.across} groups, but there are {self.groups}")
            for i in range(S):
                holders = range(i, self.world_size, S)
                for j in range(len(order)):
                    total = collectives.sim_all_reduce([parts[r][j] for r in holders])
                    for r, t in zip(holders, total):
                        parts[r][j] = t
            for s in order:
                self.reduced_on["across"][s.param] += 1
        self.reduced[e.bucket] = {s.param: [parts[r][i] for r in range(self.world_size)]
                                  for i, s in enumerate(order)}

    def _slot_grads(self, rank: int, e: ReduceBucket) -> list[torch.Tensor]:
        if not e.contiguous:
            return [self._grad(rank, s.param, e.dtype).reshape(-1) for s in e.slots]
        if e.bucket not in self.buckets:
            raise SimulationError(f"ReduceBucket {e.bucket}: nothing was copied into it")
        buf = self.buckets[e.bucket][rank]
        return [buf[s.offset:s.offset + s.numel] for s in e.slots]

    def _grad(self, rank: int, param: ParamId, dtype: str) -> torch.Tensor:
        """param.grad on `rank`, cast to the comm dtype `dtype` the effect names (checked)."""
        grad = self.grads[rank].get(param)
        if grad is None:
            raise SimulationError(f"rank {rank}: param {param} has no grad (never put, or dropped)")
        comm = self.config.communication_data_type
        want = grad.dtype if comm is None else COMM[comm]
        if want != getattr(torch, dtype):
            raise SimulationError(f"param {param}: grad is {grad.dtype}, communication_data_type is "
                                  f"{comm!r}, so it is reduced in {want}; the effect says {dtype}")
        return grad.to(want)

    def _write(self, bucket: BucketId, param: ParamId, mode: WriteMode) -> None:
        slices = self.reduced.get(bucket, {}).get(param)
        if slices is None:
            raise SimulationError(f"WritePartition of param {param}: bucket {bucket} has no "
                                  "reduced grad for it")
        for part, sl in zip(self.partitions, slices):
            part[param] = partition.write_partition(part[param], sl.to(part[param].dtype), mode)

    def _drop(self, bucket: BucketId, params: tuple[ParamId, ...], contiguous: bool) -> None:
        if self.reduced.pop(bucket, None) is None:
            raise SimulationError(f"DropGrads of bucket {bucket}, which was not reduced")
        self.buckets.pop(bucket, None)
        if contiguous:
            return  # param.grad was released at the copy; a fresh grad may be there now
        for grads in self.grads:
            for p in params:
                if grads.pop(p, None) is None:
                    raise SimulationError(f"DropGrads: param {p} has no grad to drop")

