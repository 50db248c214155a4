"""The real interpreter: runs the core's effects with torch.distributed on the tensor store.

    AllGather(h)      flat 1-D all_gather_into_tensor of the params' shards, async (overlap_comm);
                      on gloo, by Options.gloo_all_gather: point-to-point sends (p2p.py), an
                      all-reduce of the zero-padded rows, or gloo's own
    Wait(h)           wait that work, copy the output out into the params' full values (p2p:
                      the peers' shards were received in place)
    Free              params back to empty .data; their pooled memory goes too unless the
                      core will gather them again in this pass (`refetch`); hpZ: the secondary
                      shards it names are cut from the full values first
    DropSecondary     hpZ: those secondary shards go (AllGather.secondary gathers the rest of
                      them within the hpZ group: [Note: hpZ], fz3/core/stage.py)
    Refresh           gather into the params' own full values, in place, and wait (the step's
                      refresh of the persistent params): nothing taken, freed or set
    CopyToBucket      param.grad -> slice of a flat IPG bucket buffer of the effect's (comm)
                      dtype; param.grad = None
    HoldGrad          param.grad, flat and cast to the effect's dtype, kept for the bucket's
                      reduce, which reads it in place (the p2p carrier sends from it);
                      param.grad = None; counted in held_bytes until its DropGrads
    ReduceBucket      SUM all_reduce of the flat bucket, or one reduce_scatter_tensor of the
                      padded rank-interleaved grads; async with overlap_comm. Grads read from
                      param.grad are cast to the effect's dtype; all are divided by its
                      predivide first. On gloo the reduce_scatter path runs by
                      Options.gloo_reduce_scatter: point-to-point sends, the all-reduce path's
                      data plane (same partitions) or gloo's own
    WritePartition    this rank's reduced slice -> its fp32 partition (copy | add)
    DropGrads         the bucket buffer goes back to the pool, held grads are let go (not
                      contiguous: the reduce took param.grad already)
    WaitReduce        wait every reduce in flight and run the writes that waited for it
    ZeroPartitions, AverageGrads   on the partitions' segments (one division, never AVG)
    FreePartitions    the segments' storages resized to 0 after the optimizer
                      step; the window's first write (or ZeroPartitions) gives it memory again

[Note: deferred writes] With overlap_comm a reduce runs while backward goes on, so the
WritePartition / DropGrads effects that follow a ReduceBucket wait in a queue attached to that
reduce; they run when it completes: at WaitReduce, or earlier when its buffer is needed again.
On an accelerator the collectives run on side streams, ordered by the events fz3/core/streams.py
places ([Note: streams as effects]): this file runs its ops and decides nothing about streams;
on CPU (gloo) the streams are inert and the async Work objects are the only concurrency.

Every other flat buffer (gathers, the params' full values, reduce-scatter input, output and
scratch) comes from a `BufferPool` (fz3/data/pool.py): the same sizes come back every step.

How an AllGather or a ReduceBucket moves its bytes is its carrier's business (carriers.py: P2P,
Native, AllReduce), chosen once here from the options and the backend (accounting.carriers);
whether grads are copied or held is the core's (fz3.core.grad.grads.grad_route), told what the
reduce-scatter carrier does by `capabilities` (protocol.py);
this file keeps what every carrier shares: the effect dispatch, the grads a reduce reads, the
reduces in flight and the writes that wait for them.
"""
from __future__ import annotations

import contextlib
from collections import Counter, deque
from typing import Callable, Iterable, Optional, Sequence

import torch

from fz3.config.config import Config
from fz3.core.effects import (AllGather, AverageGrads, ClearGrads, CopyToBucket, DropGrads, DropSecondary, Free,
                              FreePartitions, HoldGrad, ReduceBucket, Refresh, Wait, WaitReduce, WritePartition,
                              ZeroPartitions)
from fz3.core import streams
from fz3.core.ids import BucketId, Handle
from fz3.data import layout
from fz3.data.pool import MIN_POOLED_BYTES, BufferPool
from fz3.interpreters import accounting, agreement, carriers, groups, p2p, pass_hint, shared_memory
from fz3.interpreters.protocol import Capabilities
from fz3.interpreters.transport import Transport
from fz3.config.options import Options
from fz3.data.store import TensorStore


class _Reduce:
    """One reduce in flight: its work, what to do when it completes, and what waited for it;
    `effect`: its ReduceBucket."""

    __slots__ = ("work", "finish", "deferred", "keep", "effect")

    def __init__(self, work, finish, keep, effect) -> None:
        self.work, self.finish, self.deferred, self.keep, self.effect = work, finish, [], keep, effect


class DistInterpreter:
    def __init__(self, store: TensorStore, *, config: Config, device, transport: Transport,
                 options: Options = Options(), training: Callable[[], bool] = lambda: True,
                 axes: Optional[groups.Axes] = None) -> None:
        """`transport` moves the bytes (fz3/interpreters/transport.py): torch.distributed on a
        process group, or a rank of a ThreadWorld (N ranks in one process); `options` picks the
        gloo carriers (fz3/config/options.py); `training()`: the model's train mode, which the
        divergence check's descriptors carry ([Note: rank-only evaluation], pass_hint.py).
        `axes`: under hybrid sharding, this rank's group and its replica set (groups.py): the
        gathers and reduces run in the group, the reduce across groups on the replica set, and
        everything else (the divergence check, the norm, the buffers) on the whole world."""
        self.store, self.config, self.device, self.comm = store, config, device, transport
        self.group_comm = transport if axes is None else axes.shard
        self.replica_comm = None if axes is None else axes.replica
        self.hpz_comm = None if axes is None else axes.secondary  # [Note: hpZ], fz3/core/stage.py
        # [Note: bytes on each link] (accounting.py): the group's ranks in this rank's link group
        self.local = accounting.link_local(store.spec, groups.launcher_nodes(transport.world_size))
        self.rank, self.world_size = transport.rank, transport.world_size  # the group's
        # the layout's: the ranks each param is split over, and this rank's place among them (the
        # group at stages 1-3; one rank at stage 0, whose gathers then move nothing: stage.py)
        self.shard_rank, self.shard_world = store.rank, store.world_size
        self.spec = store.spec
        self.async_op = config.overlap_comm
        self.gather_by, self.reduce_scatter_by = accounting.carriers(options, device.backend)
        # chosen once: how gathers and reduce-scatters move their bytes (carriers.py); a bucket
        # on the all-reduce path runs AllReduce's reduce whatever the reduce-scatter carrier
        self.held: dict[BucketId, dict[int, torch.Tensor]] = {}  # bucket -> offset -> grad
        self.gather_stream = device.new_stream() if self.async_op else None
        self.reduce_stream = device.new_stream() if self.async_op else None
        self.gathers: dict[Handle, tuple] = {}
        self.reduces: "deque[tuple[BucketId, _Reduce]]" = deque()  # as self.streams.reduces, with their work
        self.streams = streams.Streams()  # [Note: streams as effects]
        self.events: dict[int, object] = {}  # recorded, not yet waited
        self.before: tuple = ()  # the ops to run as the next collective enters its stream (`on`)
        self.reduced: dict[BucketId, dict[int, torch.Tensor]] = {}
        self.buffers: dict[BucketId, torch.Tensor] = {}
        self.pool: dict[str, list[torch.Tensor]] = {}
        self.bucket_capacity = accounting.bucket_capacity(config, self.reduce_scatter_by, store)
        # [Note: one size per reduce buffer] Buckets differ in size (the grad that overflows one
        # starts the next), and a pooled buffer is reused only for a take of the same size: a
        # buffer per bucket size stayed in the pool through the backward, 300 MiB per rank on
        # bench/diagnostics/memory.py's 0.3 B GPT. Every reduce buffer is cut from one of the largest size a
        # bucket can need, so one buffer serves every bucket. A bucket's shards total at most
        # capacity / W plus one element per param (each rank span rounds up), and pages a
        # smaller bucket never touches are never resident.
        self.shard_capacity = -(-self.bucket_capacity // self.shard_world) + len(self.spec.params)
        self.scratch_capacity = (self.shard_world - 1) * self.shard_capacity
        self.counts: Counter[str] = Counter()
        self.held_bytes = self.peak_held_bytes = 0  # grads held for a reduce (HoldGrad), now and at most
        owners: list[list[str]] = [[] for _ in self.spec.params]
        for m, ms in enumerate(self.spec.modules):
            for p in ms.params:
                owners[p].append(store.module_names[m])
        # [Note: descriptors beside the data] fz3/interpreters/agreement.py
        self.agreement = agreement.Agreement.for_transport(transport, agreement.describe_with(store.names, owners))
        if self.agreement is not None:  # [Note: rank-only evaluation]
            self.agreement.phase = pass_hint.phase_reader(training)
        # CPU: room for what the live budget can need at once, and no more than the model could:
        # the live full params (within max_live_parameters plus the unit fetched on demand past
        # it, fz3/core/param/fetch.py), the gathers' packed inputs (not for p2p, which sends from the
        # shards) and one reduce's buffers (p2p: the peers' partitions it receives; otherwise
        # the packed input and the output). An accelerator's caching allocator reuses memory
        # already; a pool there would only keep buffers from activations, so it holds nothing.
        elem = store.shards[0].element_size() if self.spec.params else 4
        total = sum(s.numel for s in self.spec.params)
        unit = max((sum(self.spec.params[p].numel for p in m.params) for m in self.spec.modules), default=0)
        live = min(config.max_live_parameters + unit, total)
        W = self.shard_world
        inputs = 0 if self.gather_by == "p2p" else -(-live // W)
        reduce = self.scratch_capacity if self.reduce_scatter_by == "p2p" else (W + 1) * self.shard_capacity
        limit = min((live + inputs + reduce) * elem, 3 * total * elem) + (64 << 20) \
            if store.device.type == "cpu" else 0
        self.buffers_pool = BufferPool(store.device, limit_bytes=limit, huge_pages=options.huge_pages,
                                       min_bytes=MIN_POOLED_BYTES)
        # [Note: shared-memory carrier] the P2P carrier's large messages, on one host
        by_p2p = "p2p" in (self.gather_by, self.reduce_scatter_by)
        p2p_comm = shared_memory.for_carrier(self.group_comm, options.shared_memory and by_p2p)
        ctx = carriers.Context(self.shard_rank, W, self.spec, p2p_comm, self.async_op, self.agreement,
                               self.buffers_pool.take, self.buffers_pool.take_many, self.reduce_buffer, self.on,
                               self.gather_stream, self.reduce_stream, self.bucket_capacity, self.shard_capacity,
                               self.scratch_capacity, options.gloo_coalesce_numel, self.counts)
        # a layout of one rank among several (stage 0) gathers nothing from the others: its shards
        # are whole (alone, W = 1, the chosen carrier has no peers to ask either)
        local = self.shard_world == 1 < self.world_size
        self.gather = carriers.Local(ctx) if local else carriers.CARRIERS[self.gather_by](ctx)
        self.reduce_scatter = carriers.CARRIERS[self.reduce_scatter_by](ctx)
        self.all_reduce_carrier = carriers.AllReduce(ctx)
        # hpZ: the secondary shards this rank keeps, and the carrier that gathers them within the
        # hpZ group, over the layout of its H ranks
        self.secondary: dict[int, torch.Tensor] = {}
        self.secondary_bytes = self.peak_secondary_bytes = 0
        self.hpz_carrier = None
        if self.spec.secondary > 1:
            H = self.spec.secondary
            self.hpz_rank = self.shard_rank % H
            self.hpz_local = accounting.secondary_local(self.spec, groups.launcher_nodes(transport.world_size),
                                                        transport.rank)
            hctx = ctx._replace(rank=self.hpz_rank, world_size=H, spec=self.spec.secondary_layout(), comm=self.hpz_comm)
            self.hpz_carrier = carriers.CARRIERS[self.gather_by](hctx)
        self.capabilities = Capabilities(in_place_reduce_scatter=self.reduce_scatter.reads_grads_in_place,
                                         hold_budget=self.reduce_scatter.hold_budget,
                                         shared_memory=isinstance(p2p_comm, shared_memory.SharedMemoryTransport))

    def run(self, effects: Iterable[object]) -> None:
        if torch.is_inference_mode_enabled():
            # [Note: forward-only passes] Under torch.inference_mode every new tensor is an
            # inference tensor: a pooled buffer or a persistent param's full value made there
            # could never be written in place or saved for backward again. What the effects
            # allocate outlives the pass, so it is made outside inference mode.
            with torch.inference_mode(False):
                return self._run(effects)
        return self._run(effects)

    def _run(self, effects: Iterable[object]) -> None:
        effects = effects if isinstance(effects, (list, tuple)) else list(effects)
        i, n = 0, len(effects)
        while i < n:
            e = effects[i]
            i += 1
            if type(e) is WritePartition:  # a bucket's writes, together: [Note: writes in one call]
                j = i
                while j < n and type(effects[j]) is WritePartition and effects[j].bucket == e.bucket:
                    j += 1
                writes, i = effects[i - 1:j], j
                if streams.pending(self.streams, e.bucket):
                    self._pending(e.bucket).deferred.extend(writes)
                else:
                    self._write(e.bucket, writes)
                continue
            match e:  # the cases a step takes most often first (one per grad, then per gather)
                case HoldGrad():
                    self._hold_grad(e)
                case CopyToBucket():
                    self._copy_to_bucket(e)
                case AllGather(handle=h, params=ps, prefetch=pre, secondary=sec):
                    self._all_gather(h, ps, pre, sec)
                case Wait(handle=h):
                    self._wait(h)
                case Free(params=ps, refetch=refetch, secondary=sec):
                    if sec:
                        self._keep_secondary(sec)
                    self._free(ps, refetch)
                case DropSecondary(params=ps):
                    for p in ps:
                        t = self.secondary.pop(p)
                        self.secondary_bytes -= t.numel() * t.element_size()
                case Refresh(params=ps):
                    self._refresh(ps)
                case ReduceBucket():
                    self._reduce(e)
                case DropGrads(bucket=b) if streams.pending(self.streams, b):
                    self._pending(b).deferred.append(e)
                case DropGrads(bucket=b):
                    self._drop(b)
                case WaitReduce():
                    self.streams, ops = streams.complete_all(self.streams)
                    self._stream_ops(ops)
                case ZeroPartitions(params=ps):
                    self.store.ensure_partitions(ps)
                    for p in ps:
                        if self.store.partitions[p] is not None:
                            self.store.partitions[p].zero_()
                case AverageGrads(divisor=d):
                    self.store.ensure_partitions()
                    torch._foreach_div_(self.store.segment_grads(), d)
                case FreePartitions():
                    self.store.free_partitions()
                    if self.agreement is not None:
                        self.agreement.next_step()
                case ClearGrads(params=ps):
                    for p in ps:
                        self.store.params[p].grad = None
                case _:
                    raise TypeError(f"DistInterpreter: unknown effect {e!r}")

    # ---- parameters ---------------------------------------------------------------------------

    def _shards(self, ps: tuple[int, ...], prefetch: bool) -> list[torch.Tensor]:
        """The shards a gather of `ps` sends, the gather counted."""
        shards = self.store.shards_of(ps)
        accounting.count_gather(self.counts, carrier=self.gather.name, shard_numel=sum(s.numel() for s in shards),
                                world_size=self.shard_world, element_size=shards[0].element_size(),
                                prefetch=prefetch, local=self.local)
        return shards

    def _all_gather(self, h: Handle, ps: tuple[int, ...], prefetch: bool, secondary: tuple[int, ...] = ()) -> None:
        self.streams, ops = streams.gather(self.streams, h, ps)
        if not secondary:
            work, fulls, keep = self._launch(ops, lambda: self.gather.gather(ps, self._shards(ps, prefetch)))
        elif len(secondary) == len(ps):
            work, fulls, keep = self._launch(ops, lambda: self._hpz_gather(ps, prefetch))
        else:  # some from their secondary shards, the rest from their shards: two collectives
            kept = set(secondary)
            rest = tuple(p for p in ps if p not in kept)
            work, fulls, keep = self._launch(ops, lambda: _both(
                ps, secondary, rest, self._hpz_gather(secondary, prefetch),
                self.gather.gather(rest, self._shards(rest, prefetch))))
        self.gathers[h] = (work, ps, fulls, keep)  # keep: alive until the work completes

    def _hpz_gather(self, ps: tuple[int, ...], prefetch: bool):
        """Gather `ps` from their secondary shards, within the hpZ group ([Note: hpZ])."""
        shards = [self.secondary[p] for p in ps]
        accounting.count_gather(self.counts, carrier=self.hpz_carrier.name, shard_numel=sum(s.numel() for s in shards),
                                world_size=self.spec.secondary, element_size=shards[0].element_size(),
                                prefetch=prefetch, local=self.hpz_local, secondary=True)
        return self.hpz_carrier.gather(ps, shards)

    def _keep_secondary(self, ps: tuple[int, ...]) -> None:
        """hpZ: this rank's secondary shard of each of `ps`, cut from its full value before the
        Free ([Note: hpZ])."""
        H, r, full = self.spec.secondary, self.hpz_rank, self.store.full
        for p in ps:
            f = full[p]
            t = self.secondary[p] = layout.rank_slice_into(f, r, H, torch.empty(-(-f.numel() // H), dtype=f.dtype,
                                                                                  device=f.device))
            self.secondary_bytes += t.numel() * t.element_size()
        if self.secondary_bytes > self.peak_secondary_bytes:
            self.peak_secondary_bytes = self.secondary_bytes

    def _refresh(self, ps: tuple[int, ...]) -> None:
        if self.agreement is not None:  # the step's, in no pass: unstamped
            self.agreement.stamping = False
        self.streams, ops = streams.refresh(self.streams, ps)
        try:
            work, then = self._launch(ops, lambda: self.gather.refresh(ps, self._shards(ps, False),
                                                                        [self.store.full[p] for p in ps]),
                                      work_done=True)
        finally:
            if self.agreement is not None:
                self.agreement.stamping = True
        then()
        self.store.rewritten(ps)

    def _free(self, ps: tuple[int, ...], refetch: bool) -> None:
        self.gather.forget(ps)
        if not refetch:  # next gathered in the next pass: the memory goes now
            for p in ps:
                self.buffers_pool.discard(self.store.params[p].data)
        self.store.free_many(ps)

    def _wait(self, h: Handle) -> None:
        work, ps, fulls, _ = self.gathers.pop(h)
        if work is not None:
            work.wait()  # NCCL, HCCL: compute after the collective, on the backend's stream
        self.streams, ops = streams.gathered(self.streams, h)
        self._stream_ops(ops)
        self.store.set_fulls(ps, fulls())

    # ---- gradients ------------------------------------------------------------------------------

    def _copy_to_bucket(self, e: CopyToBucket) -> None:
        param = self.store.params[e.param]
        if e.bucket not in self.buffers:
            self.buffers[e.bucket] = self._acquire(e.dtype)
        self.buffers[e.bucket][e.offset:e.offset + e.numel].copy_(param.grad.reshape(-1))
        param.grad = None

    def _hold_grad(self, e: HoldGrad) -> None:
        param = self.store.params[e.param]
        grad, dtype = param.grad, getattr(torch, e.dtype)
        if grad.dtype is not dtype:  # .to(its own dtype) is a no-op that costs ~1 us a grad
            grad = grad.to(dtype)
        grad = grad.reshape(-1)  # (numel,): a view of a contiguous grad
        held = self.held.get(e.bucket)
        if held is None:
            held = self.held[e.bucket] = {}
        held[e.offset] = grad
        param.grad = None
        self.held_bytes += e.numel * grad.itemsize
        if self.held_bytes > self.peak_held_bytes:
            self.peak_held_bytes = self.held_bytes

    def _acquire(self, dtype: str) -> torch.Tensor:
        free = self.pool.setdefault(dtype, [])
        while not free and self.streams.reduces:
            self.streams, ops = streams.complete(self.streams)  # its DropGrads returns a buffer
            self._stream_ops(ops)
        if free:
            return free.pop()
        return torch.empty(self.bucket_capacity, dtype=getattr(torch, dtype), device=self.store.device)

    def _reduce_inputs(self, e: ReduceBucket) -> tuple[list[torch.Tensor], Optional[torch.Tensor]]:
        """The grads `e` reduces, flat, in its dtype and divided by its predivide, and the bucket
        buffer they are views of (None when they are not: held grads or param.grad)."""
        d = e.predivide
        if e.contiguous and e.bucket in self.held:  # ours alone since param.grad was released
            grads = [self.held[e.bucket][s.offset] for s in e.slots]
            return [g.div_(d) for g in grads] if d != 1 else grads, None
        if e.contiguous:
            buf = self.buffers[e.bucket]
            if d != 1:
                buf[:max(s.offset + s.numel for s in e.slots)].div_(d)
            return [buf[s.offset:s.offset + s.numel] for s in e.slots], buf
        dtype = getattr(torch, e.dtype)
        grads = [self.store.params[s.param].grad.reshape(-1).to(dtype) for s in e.slots]
        for s in e.slots:
            # [Note: grads taken at the reduce] Not contiguous: the reduce reads param.grad and
            # releases it now. A later partial grad of the same param (a reentrant-checkpointed
            # region, another graph task) then starts from None instead of adding onto a grad
            # already on its way (reduced twice), and a DropGrads that completes late cannot
            # wipe it.
            self.store.params[s.param].grad = None
        return [g.div_(d) for g in grads] if d != 1 else grads, None  # released: ours alone

    def _reduce(self, e: ReduceBucket) -> None:
        path = accounting.reduce_path(e, self.reduce_scatter_by)
        # the oldest reduce completed first while MAX_REDUCES_IN_FLIGHT are out (its grads,
        # buffers and scratch let go), then this one on the reduce stream
        self.streams, ops = streams.reduce(self.streams, e.bucket)
        carrier = self.all_reduce_carrier if path == "all_reduce" else self.reduce_scatter

        def issue():
            grads, buf = self._reduce_inputs(e)
            accounting.count_reduce(self.counts, e, path=path, spec=self.spec, element_size=grads[0].element_size(),
                                    local=self.local)
            return carrier.reduce(e, grads, buf)
        work, finish, keep = self._launch(ops, issue)
        self.reduces.append((e.bucket, _Reduce(work, finish, keep, e)))
        if work is None:  # done already: completed at once, its writes not deferred
            self.streams, ops = streams.complete(self.streams, e.bucket)
            self._stream_ops(ops)

    def reduce_buffer(self, numel: int, dtype: torch.dtype, capacity: int) -> torch.Tensor:
        """A pooled (numel,) buffer for a reduce, cut from one of `capacity` elements: [Note: one
        size per reduce buffer]."""
        return self.buffers_pool.take(max(numel, capacity), dtype)[:numel]

    def end_of_backward(self) -> None:
        """Nothing is taken from the pool again before the next pass (fz3/data/pool.py)."""
        self.buffers_pool.release()

    def pool_bytes(self) -> int:
        return self.buffers_pool.bytes

    def all_reduce_sum(self, t: torch.Tensor, kind: int = agreement.NORM) -> torch.Tensor:
        if self.agreement is None:
            self.comm.all_reduce(t)
        elif t.numel() == 1 and t.dtype == torch.float64 and t.device.type == "cpu":
            return self.agreement.all_reduce_sum(t)  # the descriptor exchange carries it
        elif t.device.type != "cpu":  # the device's norm, never read on the host: compared later
            self.agreement.issue(self.agreement.ahead(kind, (), t.numel()), lambda: self.comm.all_reduce(t))
        else:
            self.agreement.issue(self.agreement.check(kind, (), t.numel()), lambda: self.comm.all_reduce(t))
        return t

    def finite(self, norm: torch.Tensor) -> bool:
        """Every rank holds the same bits of the norm (summed in rank order), so every rank
        decides alike whether the step is taken."""
        return bool(torch.isfinite(norm))

    def any_rank(self, flags: tuple[bool, ...]) -> tuple[bool, ...]:
        """One SUM of 0/1 float64 flags over ranks, checked like the norm's all-reduce."""
        if not flags:
            return ()
        t = torch.tensor(flags, dtype=torch.float64, device=self.store.device)
        return tuple(v > 0 for v in self.all_reduce_sum(t, agreement.FLAGS).tolist())

    def broadcast(self, t: torch.Tensor) -> None:
        """Every rank's `t` becomes rank 0's, checked like every collective. Where point-to-point
        messages have tags (gloo, thread worlds) rank 0 sends `t` to each peer under the
        descriptor's tag, so the descriptors travel beside it ([Note: descriptors beside the
        data]): one round trip, not a check and then a broadcast. Elsewhere the backend's own
        broadcast, once the descriptors agreed."""
        ag = self.agreement
        if ag is None:
            self.comm.broadcast(t, src=0)
        elif self.comm.backend not in ("gloo", "threads"):
            ag.issue(ag.check(agreement.BUFFERS, (), t.numel()), lambda: self.comm.broadcast(t, src=0))
        else:
            posted = ag.post(agreement.BUFFERS, (), t.numel())
            peers = list(range(1, self.world_size)) if self.rank == 0 else [0]
            post = self.comm.isend if self.rank == 0 else self.comm.irecv
            ag.guard(posted, p2p.P2PWork([post(t, j, posted.tag) for j in peers], peers)).wait()

    def bucket_bytes(self) -> int:
        """Bytes of the IPG bucket buffers allocated (0 when every grad is held: HoldGrad)."""
        bufs = [b for bs in self.pool.values() for b in bs] + list(self.buffers.values())
        return sum(b.numel() * b.element_size() for b in bufs)

    def _pending(self, bucket: BucketId) -> Optional[_Reduce]:
        for b, pending in self.reduces:
            if b == bucket:
                return pending
        return None

    def _complete_oldest(self) -> None:
        """The oldest reduce's Completed (fz3/core/streams.py: compute has waited its event): its
        output taken, and the writes and drops that waited for it run."""
        bucket, pending = self.reduces.popleft()
        if pending.work is not None:
            pending.work.wait()  # NCCL, HCCL: compute after the collective, on the backend's stream
        reduced = pending.finish()
        if pending.effect.across > 1:
            reduced = self._across(pending.effect, reduced)
        self.reduced[bucket] = reduced
        self._run(pending.deferred)

    def _across(self, e: ReduceBucket, reduced: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """[Note: hybrid sharding] The bucket's partitions, reduced within the group, all-reduced
        over the ranks that hold the same shards (one per group): one all-reduce of them
        back to back, checked like every collective."""
        params = [s.param for s in e.slots]
        parts = [reduced[p] for p in params]
        flat = torch.cat(parts)
        ag = self.agreement
        if ag is None:
            self.replica_comm.all_reduce(flat)
        else:
            ag.issue(ag.check(agreement.ACROSS, params, flat.numel()), lambda: self.replica_comm.all_reduce(flat))
        accounting.count_across(self.counts, numel=flat.numel(), element_size=flat.element_size(),
                                replicas=self.replica_comm.world_size)
        return dict(zip(params, flat.split([t.numel() for t in parts])))

    # ---- streams: [Note: streams as effects] (fz3/core/streams.py) -------------------------------

    def _stream(self, name: str):
        return self.device.current_stream() if name == streams.C else \
            self.gather_stream if name == streams.G else self.reduce_stream

    def _stream_ops(self, ops) -> None:
        for op in ops:
            match op:
                case streams.Completed(bucket=b):
                    assert self.reduces[0][0] == b, (b, self.reduces[0][0])
                    self._complete_oldest()
                case _ if self.gather_stream is None:  # overlap_comm off: one stream, nothing to order
                    pass
                case streams.Record(stream=name, event=ev):
                    self.events[ev] = self.device.record_event(self._stream(name))
                case streams.WaitEvent(stream=name, event=ev):
                    self._stream(name).wait_event(self.events.pop(ev))

    def _launch(self, ops, issue, *, work_done: bool = False):
        """Run a collective's ops around `issue()`: the reduces completed first, at once; its
        stream's wait for compute (Record, WaitEvent) as it enters the stream (`on`, after the
        copies it queues on compute first); those after its Launch once it is issued (with
        `work_done`, once its work was waited). -> what `issue` returned."""
        i = next(i for i, op in enumerate(ops) if type(op) is streams.Launch)
        self._stream_ops(ops[:i - 2])
        self.before = ops[i - 2:i]
        try:
            out = issue()
        finally:
            before, self.before = self.before, ()
        self._stream_ops(before)  # a carrier that entered no stream (nothing to move)
        if work_done and out[0] is not None:
            out[0].wait()
        self._stream_ops(ops[i + 1:])
        return out

    def _write(self, bucket: BucketId, writes: Sequence[WritePartition]) -> None:
        """[Note: writes in one call] A bucket's WritePartition effects come together, one per
        slot: its copies are one torch._foreach_copy_, its adds one _foreach_add_ (each param is
        in a bucket once, so the order among them does not matter). One call per param cost
        ~6 us each: a sixth of the deep narrow GPT's reduce, 196 small grads a step."""
        self.store.ensure_partitions(w.param for w in writes)
        parts, reduced = self.store.partitions, self.reduced[bucket]
        for mode, op in (("copy", torch._foreach_copy_), ("add", torch._foreach_add_)):
            ps = [w.param for w in writes if w.mode == mode]
            if ps:
                op([parts[p] for p in ps], [reduced[p] for p in ps])

    def _drop(self, bucket: BucketId) -> None:
        self.reduced.pop(bucket, None)
        for g in self.held.pop(bucket, {}).values():
            self.held_bytes -= g.numel() * g.element_size()
        buf = self.buffers.pop(bucket, None)
        if buf is not None:
            self.pool.setdefault(str(buf.dtype).removeprefix("torch."), []).append(buf)
        # not contiguous: the reduce released param.grad already ([Note: grads taken at the reduce])

    def on(self, stream):
        """Issue on a side stream, which first waits for what compute queued (the shards the
        optimizer wrote, the grads backward wrote, the copies the carrier just made): the ops
        before the collective's Launch (`_launch`)."""
        before, self.before = self.before, ()
        self._stream_ops(before)
        if stream is None:
            return contextlib.nullcontext()
        return self.device.stream(stream)



class _Works:
    """Two collectives' works as one (None: done)."""

    def __init__(self, *works) -> None:
        self.works = [w for w in works if w is not None]

    def wait(self) -> None:
        for w in self.works:
            w.wait()


def _both(ps: tuple[int, ...], secondary: tuple[int, ...], rest: tuple[int, ...], hpz, primary):
    """One gather of `ps` made of two carriers' (work, fulls, keep): the hpZ group's of
    `secondary` and the shard group's of `rest`; fulls in the order of `ps`."""
    (w1, f1, k1), (w2, f2, k2) = hpz, primary
    work = _Works(w1, w2) if w1 is not None or w2 is not None else None

    def fulls():
        got = dict(zip(secondary, f1()))
        got.update(zip(rest, f2()))
        return [got[p] for p in ps]
    return work, fulls, (k1, k2)
