"""Carriers: how one all-gather or one reduce moves its bytes, chosen once per interpreter.

    P2P         gloo: point-to-point sends, one per peer per message group (fz3.interpreters.messages):
                large params straight into the full values and out of the grads, small ones
                packed together (p2p.py); its data travels under a tag made from the
                divergence check's descriptor, which it compares at the wait
    Native      the backend's own all_gather_into_tensor / reduce_scatter_tensor (NCCL, HCCL,
                or gloo's own): packed into flat buffers and unpacked after (fz3.data.collectives)
    AllReduce   gloo stand-ins: an all-reduce of zero-padded rows for a gather, of the whole
                bucket for a reduce (each rank keeps its slice)
    Local       a layout of one rank (stage 0): the gather is the shard itself

`accounting.carriers(options, backend)` names the gather and reduce-scatter carriers (what the
options' gloo switches pick, or the backend's own collectives off gloo); `for_name` builds it.
A ReduceBucket whose path is "all_reduce" (the config's reduce_scatter=False) runs AllReduce's
reduce whatever the carrier. Each method posts its collective and returns (work or None when
it ran synchronously, result thunk, buffer to keep alive until the work completes); waiting,
stream syncs and the deferred writes stay in the interpreter (dist.py). Checked, a collective's
work fails with a DivergenceError naming what happened when a peer leaves mid-collective
(`Carrier.issue`, agreement.Guarded), never with a raw transport error.

`reads_grads_in_place`: the reduce sends each grad from where it lies (P2P only), so a bucket
would only stage a copy. The interpreter reports it in its `capabilities`
(in_place_reduce_scatter, protocol.py), and the core then holds grads (HoldGrad) instead of
copying them (fz3.core.grad.grads.grad_route).
`hold_budget`: the held grads a reduce gains from batching; the core reduces a bucket of held
grads at that size, not at reduce_bucket_size (fz3.core.grad.grads.capacity).
"""
from __future__ import annotations

import itertools
from collections import Counter
from typing import Callable, ContextManager, NamedTuple, Optional, Sequence

import torch

from fz3.interpreters import messages
from fz3.core.effects import ReduceBucket
from fz3.core.spec import ModelSpec
from fz3.data import collectives
from fz3.interpreters import agreement, p2p


class Context(NamedTuple):
    """What a carrier needs of the interpreter it serves (dist.py builds it), and no more."""

    rank: int
    world_size: int
    spec: ModelSpec
    comm: object  # the Transport that moves the bytes (transport.py)
    async_op: bool  # overlap_comm: collectives return work to wait on later
    agreement: Optional[agreement.Agreement]  # the divergence check; None: unchecked
    take: Callable[[int, torch.dtype], torch.Tensor]  # a buffer of that numel from the pool
    take_many: Callable[[Sequence[int], torch.dtype], list[torch.Tensor]]  # one of each numel
    reduce_buffer: Callable[[int, torch.dtype, int], torch.Tensor]  # (numel, dtype, capacity)
    on: Callable[[object], ContextManager]  # run on that stream (None: the current one)
    gather_stream: object
    reduce_stream: object
    bucket_capacity: int  # the largest bucket, in elements
    shard_capacity: int  # a bucket's largest shard on one rank
    scratch_capacity: int  # the peers' shards a p2p reduce receives
    coalesce_numel: int = 0  # p2p: params this small travel packed (Options.gloo_coalesce_numel)
    counts: Optional[Counter] = None  # the interpreter's counters: p2p_sends


AHEAD = ("nccl", "hccl", "threads")
"""The backends whose asynchronous native collectives post their data before their descriptors
are compared (`Agreement.ahead`): a mismatched one waits on the device (NCCL, HCCL) or in a
rendezvous (ranks as threads) until the wait names the divergence. gloo's own aborts the
process on a size mismatch (gloo::EnforceNotMet, in its transport thread), so there the
descriptors are compared first."""


class Carrier:
    """Shared by the three: the context it runs in (pool, transport, check, streams)."""

    name = ""
    reads_grads_in_place = False  # True: the reduce sends each grad from where it lies
    hold_budget = 0  # held grads' elements a reduce gains from batching (0: no budget)

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def check(self, kind: int, params: Sequence[int], numel: int):
        """Collectives without tags: run asynchronously on a backend of AHEAD, their descriptors
        are posted and compared at the wait (`Agreement.ahead`: the host never waits for its
        peers at issue); else the ranks' descriptors are waited for before any data is posted.
        -> the descriptors (None when unchecked), for `issue`."""
        ag = self.ctx.agreement
        if ag is None:
            return None
        return ag.ahead(kind, params, numel) if self.ctx.async_op and self.ctx.comm.backend in AHEAD else \
            ag.check(kind, params, numel)

    def issue(self, posted, post: Callable[[], object]):
        """post() the collective (-> its work, None when synchronous); checked (`posted`), a
        peer that leaves mid-collective is a DivergenceError, at the post or the work's wait."""
        return post() if posted is None else self.ctx.agreement.issue(posted, post)

    def forget(self, ps: Sequence[int]) -> None:
        """`ps` were freed (P2P drops what it kept of their full values)."""

    def refresh(self, ps: Sequence[int], shards: Sequence[torch.Tensor], fulls: Sequence[torch.Tensor]):
        """Gather `ps` into `fulls`, the full values they have (effects.Refresh). -> (work or
        None, then): once the work is waited, then() finishes. Here: a gather as any other,
        copied into place."""
        work, got, keep = self.gather(ps, shards)
        return work, lambda: torch._foreach_copy_(fulls, got())  # keep: alive until then


class P2P(Carrier):
    name = "p2p"
    reads_grads_in_place = True  # p2p.reduce_scatter sends each rank's slice of each grad
    hold_budget = 16 * messages.GROUP_MOST
    """It sends grad by grad, packing only the small ones (at most GROUP_MOST elements a message),
    so a reduce of more held grads gains only fewer per-reduce costs (its effects, the divergence
    check's descriptors): at 16 M elements (64 MiB of fp32) those are nothing beside the bytes.
    The core reduces held buckets at this size ([Note: hold budget], fz3/core/grad/grads.py)."""

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.tags = itertools.count(1)  # message tags unchecked: the same sequence on every rank (SPMD)
        self.grouped: dict[tuple[int, ...], tuple[tuple[int, ...], ...]] = {}  # params -> groups
        self.reduce_layouts: dict[tuple[int, ...], p2p.ReduceLayout] = {}  # params -> where a reduce's bytes go
        self.gather_plans: dict[tuple[int, ...], p2p.GatherPlan] = {}  # params -> a gather's spans
        self.layout: Optional[p2p.GatherLayout] = None  # the last refresh's, of these params:
        self.layout_key: tuple[int, ...] = ()
        self.layout_params: frozenset[int] = frozenset()

    def forget(self, ps: Sequence[int]) -> None:
        """`ps` were freed: a layout over any of them goes, so its views of their full values do
        not keep that memory (a pooled buffer no one could take)."""
        if self.layout is not None and not self.layout_params.isdisjoint(ps):  # O(len(ps)): at every Free
            self.layout, self.layout_key, self.layout_params = None, (), frozenset()

    def stage(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A packed group's staging buffer: cut from a pooled one of GROUP_MOST elements, the most
        a group holds, so one size serves every group ([Note: one size per reduce buffer] in
        dist.py); pages a small group never touches are never resident."""
        return self.ctx.reduce_buffer(numel, dtype, messages.GROUP_MOST)

    def groups(self, params: Sequence[int]) -> tuple[tuple[int, ...], ...]:
        """The message groups of a collective over `params` (fz3.interpreters.messages), made once per
        param set: the trace repeats them every step."""
        key = tuple(params)
        got = self.grouped.get(key)
        if got is None:
            spec = self.ctx.spec.params
            got = self.grouped[key] = messages.groups([spec[p].numel for p in key], small=self.ctx.coalesce_numel)
        return got

    def gather_plan(self, params: Sequence[int]) -> p2p.GatherPlan:
        """The spans a gather of `params` moves (p2p.GatherPlan)."""
        return self._once(self.gather_plans, params, p2p.GatherPlan)

    def reduce_layout(self, params: Sequence[int]) -> p2p.ReduceLayout:
        """Where a reduce of `params` takes and puts its bytes (p2p.ReduceLayout)."""
        return self._once(self.reduce_layouts, params, p2p.ReduceLayout)

    def _once(self, made: dict, params: Sequence[int], make: Callable):
        """make(numels, rank, world_size, groups) for `params`, made once per param set, as its
        groups are: the trace repeats them every step."""
        key = tuple(params)
        got = made.get(key)
        if got is None:
            it = self.ctx
            got = made[key] = make([it.spec.params[p].numel for p in key], it.rank, it.world_size, self.groups(key))
        return got

    def tag(self, kind: int, params: Sequence[int], numel: int):
        """-> (posted descriptors or None, tag): with the divergence check the tag is made from
        the collective's descriptor ([Note: descriptors beside the data]), else the next of a
        counter."""
        if self.ctx.agreement is None:
            return None, next(self.tags)
        posted = self.ctx.agreement.post(kind, params, numel)
        return posted, posted.tag

    def posted(self, work: p2p.P2PWork, posted):
        """Point-to-point work is always async; without overlap_comm it is waited here. Waiting
        it first compares the descriptors it was posted under (`posted`, None when unchecked)."""
        if self.ctx.counts is not None:
            self.ctx.counts["p2p_sends"] += work.sends
        if posted is not None:
            work = self.ctx.agreement.guard(posted, work)
        if not self.ctx.async_op:
            work.wait()
            return None
        return work

    def gather(self, ps: Sequence[int], shards: Sequence[torch.Tensor]):
        it = self.ctx
        # a buffer per param: freeing one frees its memory (a flat buffer for the batch would
        # live until the last of its params is freed); a packed group's params padded to W * s_i,
        # so that its rows are copied out in one op ([Note: packed groups in rows], p2p.py)
        plan = self.gather_plan(ps)
        numels = [it.spec.params[p].numel for p in ps]
        bufs = it.take_many(p2p.padded_numels(numels, it.world_size, plan), shards[0].dtype)
        fulls = [b if b.numel() == n else b[:n] for b, n in zip(bufs, numels)]
        layout = p2p.GatherLayout(fulls, it.rank, it.world_size, self.groups(ps), plan, padded=bufs)
        return self._gather_into(ps, shards, fulls, layout), (lambda: fulls), None

    def _gather_into(self, ps: Sequence[int], shards: Sequence[torch.Tensor], fulls: Sequence[torch.Tensor],
                     layout: p2p.GatherLayout):
        """Post the gather of `ps` into `fulls` by `layout`; -> its work (None: done)."""
        it = self.ctx
        posted, tag = self.tag(agreement.GATHER, ps, sum(it.spec.params[p].numel for p in ps))
        with it.on(it.gather_stream):
            work = p2p.all_gather(fulls, shards, it.comm, tag=tag, take=self.stage, layout=layout)
        return self.posted(work, posted)

    def refresh(self, ps: Sequence[int], shards: Sequence[torch.Tensor], fulls: Sequence[torch.Tensor]):
        """The peers' shards received straight into `fulls` (p2p.all_gather writes in place), by
        the layout made the last time these params were refreshed into these same full values:
        every step's refresh after the first (p2p.GatherLayout). By rows where the full values lie
        in the padded buffers a gather by rows made them in (`gather`)."""
        it = self.ctx
        key, layout = tuple(ps), self.layout
        if layout is None or key != self.layout_key or not layout.same_fulls(fulls):
            plan = self.gather_plan(key)
            want = p2p.padded_numels([f.numel() for f in fulls], it.world_size, plan)
            layout = self.layout = p2p.GatherLayout(fulls, it.rank, it.world_size, self.groups(key), plan,
                                                    padded=_padded_bases(fulls, want))
            self.layout_key, self.layout_params = key, frozenset(key)
        return self._gather_into(ps, shards, fulls, layout), _nothing

    def reduce(self, e: ReduceBucket, grads: list[torch.Tensor], buf: Optional[torch.Tensor]):
        it = self.ctx
        params = [s.param for s in e.slots]
        layout = self.reduce_layout(params)
        keep = it.reduce_buffer(layout.scratch_numel, grads[0].dtype, it.scratch_capacity)
        posted, tag = self.tag(agreement.REDUCE, params, sum(s.numel for s in e.slots))
        with it.on(it.reduce_stream):
            work, reduced = p2p.reduce_scatter(grads, keep, it.comm, tag=tag, take=self.stage,
                                               layout=layout)
        return self.posted(work, posted), (lambda: dict(zip(params, reduced()))), keep


def _padded_bases(fulls: Sequence[torch.Tensor], want: Sequence[int]) -> Optional[list[torch.Tensor]]:
    """The buffer of `want[i]` elements each full value starts, as `P2P.gather` made it (the
    value itself, or the view it is of), or None where one is not such a buffer."""
    out = []
    for f, n in zip(fulls, want):
        b = f if f.numel() == n else f._base
        if b is None or b.numel() != n or b.data_ptr() != f.data_ptr() or not b.is_contiguous():
            return None
        out.append(b)
    return out


class Native(Carrier):
    name = "native"
    reads_grads_in_place = True  # its one copy-in (_chunk_cat) packs the held grads where they
    # lie: a bucket would be a second copy of each grad ([Note: copy or hold], grads.py)

    def gather(self, ps: Sequence[int], shards: Sequence[torch.Tensor]):
        it = self.ctx
        posted = self.check(agreement.GATHER, ps, sum(it.spec.params[p].numel for p in ps))
        S = sum(s.numel() for s in shards)
        out = it.take(S * it.world_size, shards[0].dtype)
        inp = shards[0] if len(shards) == 1 else torch.cat(shards, out=it.take(S, shards[0].dtype))
        with it.on(it.gather_stream):
            work = self.issue(posted, lambda: it.comm.all_gather_into(out, inp, async_op=it.async_op))
        return work, (lambda: unpack(it, out, ps)), inp  # inp alive until done

    def reduce(self, e: ReduceBucket, grads: list[torch.Tensor], buf: Optional[torch.Tensor]):
        it, W = self.ctx, self.ctx.world_size
        params = [s.param for s in e.slots]
        posted = self.check(agreement.REDUCE, params, sum(s.numel for s in e.slots))
        order = sorted(range(len(e.slots)), key=lambda i: params[i])
        params = [params[i] for i in order]
        S = sum(it.spec.params[p].shard_numel for p in params)
        keep = collectives.pack_reduce_scatter_into([grads[i] for i in order], W,
                                                    it.reduce_buffer(W * S, grads[0].dtype, W * it.shard_capacity))
        out = it.reduce_buffer(S, keep.dtype, it.shard_capacity)
        with it.on(it.reduce_stream):
            work = self.issue(posted, lambda: it.comm.reduce_scatter_into(out, keep, async_op=it.async_op))
        numels = [it.spec.params[p].numel for p in params]
        return work, (lambda: dict(zip(params, collectives.unpack_reduce_scatter(out, numels, W)))), keep


class AllReduce(Carrier):
    name = "all_reduce"

    def gather(self, ps: Sequence[int], shards: Sequence[torch.Tensor]):
        it, W = self.ctx, self.ctx.world_size
        posted = self.check(agreement.GATHER, ps, sum(it.spec.params[p].numel for p in ps))
        S = sum(s.numel() for s in shards)
        out = it.take(S * W, shards[0].dtype)
        rows = out.view(W, S)
        rows[:it.rank].zero_()
        rows[it.rank + 1:].zero_()
        inp = torch.cat(shards, out=rows[it.rank])
        with it.on(it.gather_stream):
            work = self.issue(posted, lambda: it.comm.all_reduce(out, async_op=it.async_op))
        return work, (lambda: unpack(it, out, ps)), inp

    def reduce(self, e: ReduceBucket, grads: list[torch.Tensor], buf: Optional[torch.Tensor]):
        it = self.ctx
        posted = self.check(agreement.REDUCE, [s.param for s in e.slots], sum(s.numel for s in e.slots))
        if buf is not None:  # the grads are views of the flat bucket (copied, not held)
            flat = buf[:max(s.offset + s.numel for s in e.slots)]
            spans = [(s.offset, s.numel) for s in e.slots]
        else:
            flat = it.reduce_buffer(sum(g.numel() for g in grads), grads[0].dtype, it.bucket_capacity)
            torch.cat(grads, out=flat)
            spans = list(zip(collectives.slot_offsets([s.numel for s in e.slots]), [s.numel for s in e.slots]))
        with it.on(it.reduce_stream):
            work = self.issue(posted, lambda: it.comm.all_reduce(flat, async_op=it.async_op))
        return work, (lambda: dict(zip((s.param for s in e.slots),
                                       collectives.slice_allreduced(flat, spans, it.rank, it.world_size)))), flat


class Local(Carrier):
    """The layout of one rank (ZeRO stage 0: every rank's shard is the whole param,
    fz3/core/stage.py): the full value is the shard itself (the fp32 master, or its compute-dtype
    copy, which refresh_shards writes in place), so nothing is copied or kept twice and nothing
    moves between ranks. The reduces still span every rank (AllReduce, the allreduce path)."""

    name = "local"

    def gather(self, ps: Sequence[int], shards: Sequence[torch.Tensor]):
        fulls = [s[:self.ctx.spec.params[p].numel] for p, s in zip(ps, shards)]
        return None, (lambda: fulls), None

    def refresh(self, ps: Sequence[int], shards: Sequence[torch.Tensor], fulls: Sequence[torch.Tensor]):
        for full, shard in zip(fulls, shards):
            if full.data_ptr() != shard.data_ptr():  # a full value that is its shard is current
                full.copy_(shard[:full.numel()])
        return None, _nothing

    def reduce(self, e: ReduceBucket, grads: list[torch.Tensor], buf: Optional[torch.Tensor]):
        raise AssertionError("a layout of one rank reduces on the allreduce path (Config.reduce_path)")


def _nothing() -> None:
    pass


def unpack(it: Context, out: torch.Tensor, ps: Sequence[int]) -> list[torch.Tensor]:
    """The full values of `ps` from a rank-major gathered buffer."""
    numels = [it.spec.params[p].numel for p in ps]
    if len(ps) == 1:
        return [out[:numels[0]]]  # rank-major of one param: already its flat value
    return collectives.unpack_gather_into(out, numels, it.world_size,
                                          it.take(collectives.padded_numel(numels, it.world_size), out.dtype))


CARRIERS: dict[str, Callable] = {"p2p": P2P, "native": Native, "all_reduce": AllReduce}
