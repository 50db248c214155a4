"""The planning interpreter: runs the core's effects on a store of fake tensors, moving no data
and needing no process group, and counts what the real interpreter (dist.py) would count.

fz3.plan builds the real engine on a fake copy of the model (fz3/observe/fake.py), as rank 0 of
any world size, with this interpreter: every decision is the core's, so the gathers, prefetches,
buckets and reduces are the run's own, and fz3/interpreters/accounting.py counts them as
DistInterpreter does. A gathered param gets a fake full value (shape, no memory; made inside
the plan's FakeTensorMode), a reduce only its counters; grads are
taken out of param.grad where the real interpreter takes them (CopyToBucket, HoldGrad, a
non-contiguous ReduceBucket); only CopyToBucket makes a bucket buffer. It reports the same
`capabilities` as the real interpreter would, so the core routes grads alike. Every
rank runs the same effects on shards of the same size (I6), so rank 0's figures are every
rank's.

What it cannot know is runtime: the process's memory, the CPU buffer pool's cache (pool_bytes),
how long anything takes.
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable

import torch

from fz3.config.config import Config
from fz3.core.effects import (AllGather, AverageGrads, ClearGrads, CopyToBucket, DropGrads, DropSecondary, Free,
                              FreePartitions, HoldGrad, ReduceBucket, Refresh, Wait, WaitReduce, WritePartition,
                              ZeroPartitions)
from fz3.interpreters import messages
from fz3.core.ids import Handle
from fz3.interpreters import accounting, carriers
from fz3.interpreters.protocol import Capabilities
from fz3.config.options import Options
from fz3.data.store import TensorStore


class PlanInterpreter:
    def __init__(self, store: TensorStore, *, config: Config, backend: str, options: Options = Options(),
                 world_size: int = 1, ranks_per_node: int | None = None) -> None:
        """`world_size`: the planned world; `ranks_per_node`: its nodes, for the bytes on each
        link of flat ZeRO-3 ([Note: bytes on each link], accounting.py)."""
        self.store, self.config = store, config
        nodes = ranks_per_node if ranks_per_node != world_size else None
        self.local = accounting.link_local(store.spec, nodes)
        hpz = store.spec.secondary > 1  # [Note: hpZ], fz3/core/stage.py: its group's layout and link
        self.hpz_spec = store.spec.secondary_layout() if hpz else None
        self.hpz_local = accounting.secondary_local(store.spec, nodes, store.rank) if hpz else None
        self.spec = store.spec
        self.gather_by, self.reduce_scatter_by = accounting.carriers(options, backend)
        self.coalesce_numel = options.gloo_coalesce_numel
        self.bucket_capacity = accounting.bucket_capacity(config, self.reduce_scatter_by, store)
        self.bucket_dtypes: set[str] = set()  # one IPG buffer per comm dtype, made at first use
        self.gathers: dict[Handle, tuple[int, ...]] = {}
        self.fulls: dict[int, torch.Tensor] = {}  # param -> its full value, reused by every gather
        self.counts: Counter[str] = Counter()
        self.held: dict[int, int] = {}  # bucket -> bytes of the grads it holds (HoldGrad)
        self.dropping: list[int] = []  # buckets whose reduce is in flight (overlap_comm): their
        # grads go when it completes, at the next reduce or WaitReduce, as in DistInterpreter
        self.held_bytes = self.peak_held_bytes = 0  # as DistInterpreter counts them
        self.secondary_bytes = self.peak_secondary_bytes = 0  # hpZ's secondary shards ([Note: hpZ])
        # what comes and goes within a step, together: gathered (or in-flight) params, grad
        # partitions (a segment from its first write to the optimizer step), held grads. Their
        # joint peak is the model states' peak over the steady ones (shards, optimizer state);
        # the peaks of each alone would add up to more than is ever held at once
        self.live_numel = self.peak_live_numel = 0  # the core's live count: gathered or in flight
        self.grad_bytes = self.peak_grad_bytes = 0
        self.peak_joint = 0
        carrier = carriers.CARRIERS[self.reduce_scatter_by]  # what DistInterpreter would say
        self.capabilities = Capabilities(in_place_reduce_scatter=carrier.reads_grads_in_place,
                                         hold_budget=carrier.hold_budget)
        self.agreement = None  # one rank, no peers to agree with

    def run(self, effects: Iterable[object]) -> None:
        for e in effects:
            match e:
                case AllGather(handle=h, params=ps, prefetch=pre, secondary=sec):
                    kept = set(sec)
                    rest = tuple(p for p in ps if p not in kept) if sec else ps
                    if rest:  # from their shards, within the shard group
                        self._count_gather(rest, pre)
                    if sec:  # hpZ: from their secondary shards, within the hpZ group
                        self._count_gather(sec, pre, secondary=True)
                    self.gathers[h] = ps
                    self.live_numel += sum(self.spec.params[p].numel for p in ps)
                    self.peak_live_numel = max(self.peak_live_numel, self.live_numel)
                case Refresh(params=ps):  # into the full values they have: nothing to set
                    self._count_gather(ps, False)
                case Wait(handle=h):
                    for p in self.gathers.pop(h):
                        self.store.set_full(p, self._full(p))
                case Free(params=ps, secondary=sec):
                    self._secondary(sec, 1)
                    for p in ps:
                        self.store.free(p)
                    self.live_numel -= sum(self.spec.params[p].numel for p in ps)
                case DropSecondary(params=ps):
                    self._secondary(ps, -1)
                case CopyToBucket(param=p, dtype=dtype):
                    self.bucket_dtypes.add(dtype)
                    self.store.params[p].grad = None
                case HoldGrad(bucket=b, param=p, dtype=dtype, numel=n):  # read where it lies: no bucket buffer
                    self.store.params[p].grad = None
                    size = n * getattr(torch, dtype).itemsize
                    self.held[b] = self.held.get(b, 0) + size
                    self.held_bytes += size
                    self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
                case ReduceBucket():
                    self._completed()
                    path = accounting.reduce_path(e, self.reduce_scatter_by)
                    accounting.count_reduce(self.counts, e, path=path, spec=self.spec,
                                            element_size=getattr(torch, e.dtype).itemsize, local=self.local)
                    if path == "p2p":
                        self._count_sends([s.param for s in e.slots], gather=False)
                    if e.across > 1:  # [Note: hybrid sharding]: the partitions, back to back
                        accounting.count_across(self.counts, numel=sum(self.spec.params[s.param].shard_numel
                                                                       for s in e.slots),
                                                element_size=getattr(torch, e.dtype).itemsize, replicas=e.across)
                    if not e.contiguous:  # the reduce takes param.grad (dist.py)
                        for s in e.slots:
                            self.store.params[s.param].grad = None
                case WritePartition(param=p):
                    self.store.ensure_partitions((p,))
                    self._grads_changed()
                case ZeroPartitions(params=ps):
                    self.store.ensure_partitions(ps)
                    self._grads_changed()
                case AverageGrads():
                    self.store.ensure_partitions()
                    self._grads_changed()
                case FreePartitions():
                    self.store.free_partitions()
                    self._grads_changed()
                case DropGrads(bucket=b):
                    self.dropping.append(b)
                    if not self.config.overlap_comm:
                        self._completed()
                case WaitReduce():
                    self._completed()
                case ClearGrads():
                    pass  # grads waiting in param.grad: the plan counts none (fake tensors)
                case _:
                    raise TypeError(f"PlanInterpreter: unknown effect {e!r}")
            self.peak_joint = max(self.peak_joint, self.joint_bytes())

    def joint_bytes(self) -> int:
        """Gathered params + grad partitions + held grads, now."""
        return self.live_numel * self.store.dtype.itemsize + self.grad_bytes + self.held_bytes + self.secondary_bytes

    def _secondary(self, ps, sign: int) -> None:
        """hpZ's secondary shards of `ps` kept (+1) or dropped (-1): 1/H of each, padded."""
        H = self.spec.secondary
        self.secondary_bytes += sign * sum(-(-self.spec.params[p].numel // H) for p in ps) * self.store.dtype.itemsize
        self.peak_secondary_bytes = max(self.peak_secondary_bytes, self.secondary_bytes)

    def _grads_changed(self) -> None:
        self.grad_bytes = self.store.grad_bytes()
        self.peak_grad_bytes = max(self.peak_grad_bytes, self.grad_bytes)

    def _count_gather(self, ps, prefetch: bool, secondary: bool = False) -> None:
        """A gather of `ps`'s shards within the shard group, or (`secondary`) of their hpZ
        secondary shards within the hpZ group, as DistInterpreter counts it."""
        spec = self.hpz_spec if secondary else self.spec
        accounting.count_gather(self.counts, carrier=self.gather_by,
                                shard_numel=sum(spec.params[p].shard_numel for p in ps),
                                world_size=spec.world_size, element_size=self.store.dtype.itemsize,
                                prefetch=prefetch, local=self.hpz_local if secondary else self.local,
                                secondary=secondary)
        if self.gather_by == "p2p":
            self._count_sends(ps, gather=True, spec=spec)

    def _count_sends(self, ps, *, gather: bool, spec=None) -> None:
        """p2p_sends as the point-to-point carrier posts them on this rank (fz3/interpreters/messages.py)."""
        spec = spec or self.spec
        numels = [spec.params[p].numel for p in ps]
        groups = messages.groups(numels, small=self.coalesce_numel)
        self.counts["p2p_sends"] += accounting.p2p_sends(numels, groups, self.store.rank % spec.world_size,
                                                         spec.world_size, gather=gather)

    def _completed(self) -> None:
        """The reduces in flight completed: their held grads are let go (DistInterpreter allows
        one reduce in flight, completed before the next is issued)."""
        for b in self.dropping:
            self.held_bytes -= self.held.pop(b, 0)
        self.dropping = []

    def _full(self, p: int) -> torch.Tensor:
        """A full value for param p, made once: it holds no data, so every gather may reuse it
        (one op less per gather on the fake tensors fz3.plan runs on)."""
        full = self.fulls.get(p)
        if full is None:
            full = self.fulls[p] = torch.empty(self.spec.params[p].numel, dtype=self.store.dtype,
                                               device=self.store.device)
        return full

    def end_of_backward(self) -> None:
        """No pool to release."""

    def bucket_bytes(self) -> int:
        """The IPG bucket buffers the real interpreter would have made: one per comm dtype."""
        return sum(self.bucket_capacity * getattr(torch, d).itemsize for d in self.bucket_dtypes)

    def pool_bytes(self) -> int:
        """No pool: what the CPU pool caches is runtime, not planned."""
        return 0

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """No peers: the values of a fake tensor are nobody's."""
        return t

    def finite(self, norm: torch.Tensor) -> bool:
        """A planned step is taken: the plan assumes finite grads (a skipped step moves nothing
        more than the step it replaces, so the counts are the same either way)."""
        return True

    def broadcast(self, t: torch.Tensor) -> None:
        """No peers: rank 0's buffers are the ones it has."""

    def any_rank(self, flags: tuple[bool, ...]) -> tuple[bool, ...]:
        """Every rank runs the same effects on the same shapes: rank 0's flags are every rank's."""
        return flags
