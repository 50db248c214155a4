"""The tensor store: the only mutable tensors of fz3, one row per ParamId.

    params[p]      the user's nn.Parameter; .data is the full value while AVAILABLE, an empty
                   tensor otherwise (autograd keeps the same Parameter object throughout)
    full[p]        that full value, flat (numel,), while AVAILABLE; None otherwise
    masters[p]     fp32 shard (s,), an nn.Parameter the user's optimizer steps on; a view of
                   its segment's flat masters (a run is one optimizer param group's trainable
                   params, cut into segments: [Note: flat steps], fz3/shell/flat_step.py)
    shards[p]      compute-dtype shard (s,) the gathers read; *is* masters[p] in fp32 mode
    partitions[p]  fp32 grad partition (s,): a view of its segment's flat grads (segments:
                   a run cut into whole params, each segment its own storage), also
                   masters[p].grad at the optimizer step (with `host`: host_partitions[p], its
                   copy in host memory, is). A segment's memory exists from a
                   window's first write into it to its optimizer step (effects.FreePartitions):
                   in between, its storage is resized to 0 and the views must not be read

Sizes: s = ceil(numel / W); rank r owns flat [r*s, (r+1)*s), zero-padded (fz3/core/spec.py).
"""
from __future__ import annotations

from typing import Callable, Iterable, NamedTuple, Sequence

import torch
from torch import nn

from fz3.core.spec import ModelSpec, padding
from fz3.data import layout
from fz3.data.pages import advise_huge

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class TensorStore:
    """The shell hands it the model's params and this rank's fp32 shard of each (`shards`: from
    the Init that built them sharded, or cut from the full values), and tells it the units'
    spec and module names (`take_units`): the interpreters read them here."""

    def __init__(self, params: list[nn.Parameter], names: tuple[str, ...], shards: list[torch.Tensor], *,
                 rank: int, world_size: int, compute_dtype: str, device: torch.device,
                 runs: Sequence[Sequence[int]] = (), huge_pages: bool = False, separate_shards: bool = False,
                 segment_numel: int | None = None, host: torch.device | None = None, pin: bool = False,
                 params_on_host: bool = False) -> None:
        """`shards` is handed over: each entry is let go once copied into its segment's masters,
        so a model built sharded (fz3.Init) is never held twice over (the copy of a 3.5 B model's
        shards would double what its rank holds at initialize).
        `runs`: trainable ParamIds of one optimizer param group each, in its order, cut into
        segments whose masters and grad partitions are flat ([Note: flat steps],
        fz3/shell/flat_step.py). The
        trainable params in no run follow as one more run, in id order. `huge_pages`: a
        segment's memory, each time it comes back, is advised for huge pages ([Note: huge pages
        for fresh buffers], fz3/data/pages.py). `separate_shards`: the compute shards are copies of
        the masters even in fp32, so the masters can leave memory (optimizer offload:
        fz3/core/offload.py). `segment_numel`: segments closed at this many elements (whole
        params, a larger one alone) instead of MIN_SEGMENT or the largest shard: under offload, the
        sub_group_size, so that the sub-groups cut from the segments are DeepSpeed's."""
        self.huge_pages = huge_pages
        self.rank, self.world_size = rank, world_size
        self.dtype = DTYPES[compute_dtype]
        self.separate = separate_shards or host is not None or self.dtype != torch.float32  # shards apart
        self.device = device
        self.host = host
        home = device if host is None else host  # where the masters live
        self.params_on_host, self.pin = params_on_host and host is not None, pin
        self.param_bytes_to_device = 0  # the params' shards copied to the device for their gathers
        self.params, self.names = params, names
        self.spec: ModelSpec | None = None  # the fetch units' spec, and their modules' names
        self.module_names: tuple[str, ...] = ()
        self.shapes = [p.shape for p in self.params]
        self.trainable = [p.requires_grad for p in self.params]
        self.runs = _complete_runs(runs, self.trainable)
        self.masters: list[nn.Parameter] = [None] * len(params)  # type: ignore[list-item]
        # each run cut into segments of whole params: a segment's fp32 masters are one tensor with
        # a storage of its own, and so are its grad partitions, there only from the window's
        # first write into them to the optimizer step; the offloaded sub-groups' masters are on
        # disk between steps (fz3/core/offload.py)
        self.partitions: list[torch.Tensor | None] = [None] * len(params)
        self.host_partitions: list[torch.Tensor | None] = [None] * len(params)
        self.segments: list[Segment] = []
        self.segment_of: list[int] = [-1] * len(params)  # by param: its segment (-1: frozen)
        for r, run in enumerate(self.runs):
            start = 0
            for ps in _cut(run, [shards[p].numel() for p in run], segment_numel):
                numel = sum(shards[p].numel() for p in ps)
                masters = torch.empty(numel, dtype=torch.float32, device=home, pin_memory=pin)
                grads = torch.empty(numel, dtype=torch.float32, device=device)
                host_grads = None if host is None else torch.empty(numel, dtype=torch.float32, device=host,
                                                                   pin_memory=pin)
                offset = 0
                for p in ps:
                    n = shards[p].numel()
                    masters[offset:offset + n].copy_(shards[p].reshape(-1))
                    shards[p] = torch.empty(n, device="meta")  # copied: its memory goes now, not at the end
                    self.masters[p] = nn.Parameter(masters[offset:offset + n])
                    self.partitions[p] = grads[offset:offset + n]
                    if host_grads is not None:
                        self.host_partitions[p] = host_grads[offset:offset + n]
                    self.segment_of[p] = len(self.segments)
                    offset += n
                grads.untyped_storage().resize_(0)  # the views made, the memory waits for a write
                self.segments.append(Segment(r, start, ps, grads, masters, host_grads))
                start += offset
        for p, (param, shard) in enumerate(zip(params, shards)):
            if self.masters[p] is None:  # frozen: in no run, stepped by nobody
                self.masters[p] = nn.Parameter(shard.to(device=home, dtype=torch.float32, copy=True),
                                               requires_grad=False)
        self.shards: list[torch.Tensor] = []
        self.refresh_shards()
        self._empty = torch.empty(0, dtype=self.dtype, device=device)
        # the one element a freed param whose grad is due keeps its shape over: NaN, so a read
        # that went past fz3's hooks (a weight reached through a list, a closure) gives NaN, not
        # whatever that memory held
        self._nan = torch.full((), float("nan"), dtype=self.dtype, device=device)
        # param offload (fz3/shell/offload.py): reads the shard of a param whose memory is on disk
        self.from_disk: Callable[[int], torch.Tensor] | None = None
        self.grad_due: set[int] = set()  # freed params whose grad autograd has yet to accumulate
        self.full_spans: dict[int, list[tuple[int, int, int]]] = {}  # storage -> (offset, numel, param)
        self.full_key: list[int] = [0] * len(params)  # by param: the storage of full[p] while it is set
        self.full: list[torch.Tensor | None] = [None] * len(params)
        for p in range(len(self.params)):
            self.free(p)

    def take_units(self, spec: ModelSpec, module_names: tuple[str, ...]) -> None:
        """The fetch units the interpreters serve: at initialize, and again when
        engine.compile() makes compiled blocks units."""
        self.spec, self.module_names = spec, tuple(module_names)

    def refresh_shards(self, params: Sequence[int] | None = None, non_blocking: bool = False) -> None:
        """Compute-dtype shards from the fp32 masters of `params` (None: all; after each optimizer
        step), written into the shards there are: a full value that is its shard (a layout of one
        rank, stage 0: carriers.Local) keeps reading it, and no second copy is made. With `host`,
        each is a copy from host memory to the device (`non_blocking`: issued, not waited for)."""
        if not self.separate:
            self.shards = [m.data for m in self.masters]
        elif self.shards:
            ps = range(len(self.masters)) if params is None else params
            torch._foreach_copy_([self.shards[p] for p in ps], [self.masters[p].detach() for p in ps],
                                 non_blocking=non_blocking)
        else:
            where = self.host if self.params_on_host else self.device
            self.shards = [m.detach().to(device=where, dtype=self.dtype, copy=True) for m in self.masters]
            if self.params_on_host and self.pin:
                self.shards = [t.pin_memory() for t in self.shards]

    def grads_to_host(self, segments: Iterable[int], non_blocking: bool = False) -> int:
        """Copy the grads of `segments` to their host buffers (with `host`); -> bytes copied. A
        segment no grad reached holds no memory (its params step without a grad: bind_grads)."""
        copied = 0
        for s in segments:
            seg = self.segments[s]
            if seg.grads.untyped_storage().nbytes():
                seg.host_grads.copy_(seg.grads, non_blocking=non_blocking)
                copied += seg.grads.numel() * 4
        return copied

    def shard(self, p: int) -> torch.Tensor:
        """Param p's compute shard, as a gather sends it: read from disk when its memory is there
        (params on NVMe: the shard is the fp32 master, which the optimizer's sub-group keeps on
        disk between steps), copied to the device when it lives in host memory (`params_on_host`)."""
        shard = self.shards[p]
        if self.from_disk is not None and shard.numel() and shard.untyped_storage().nbytes() == 0:
            return self.from_disk(p)
        if self.params_on_host:  # in host memory: a copy on the device
            self.param_bytes_to_device += shard.numel() * shard.element_size()
            return shard.to(self.device, non_blocking=self.pin, copy=True)
        return shard

    def shards_of(self, ps: Sequence[int]) -> list[torch.Tensor]:
        """`shard` of each of `ps` (a gather's): the shards themselves where none is on disk or
        in host memory (196 calls a step on the deep narrow GPT, every param sharded)."""
        if self.from_disk is None and not self.params_on_host:
            shards = self.shards
            return [shards[p] for p in ps]
        return [self.shard(p) for p in ps]

    def set_full(self, p: int, flat: torch.Tensor) -> None:
        """Param p becomes AVAILABLE: its .data is the gathered full value (numel,). A persistent
        param's compute shard becomes its slice of that value ([Note: a kept param holds its
        shard])."""
        self.set_fulls((p,), (flat,))

    def set_fulls(self, ps: Sequence[int], flats: Iterable[torch.Tensor]) -> None:
        """`set_full` of each of `ps` (a gather's params), in one loop: 196 a step on the deep
        narrow GPT with every param sharded."""
        params, shapes, full, spans, spec = self.params, self.shapes, self.full, self.full_spans, self.spec
        for p, flat in zip(ps, flats):
            params[p].data = flat.view(shapes[p])
            if full[p] is not None:
                self._forget(p)
            full[p] = flat
            key = self.full_key[p] = _storage(flat)
            spans.setdefault(key, []).append((flat.storage_offset(), flat.numel(), p))
            if spec is not None and spec.params[p].persistent and self.separate and not self.params_on_host \
                    and padding(flat.numel(), self.world_size) == 0:
                n = self.shards[p].numel()
                self.shards[p] = flat[self.rank * n:(self.rank + 1) * n]

    # [Note: a kept param holds its shard]
    # A persistent param (every param at stages 0-2: fz3/core/stage.py) stays gathered, and the
    # gathered value holds this rank's shard, bit for bit, at [rank*s, (rank+1)*s). So its
    # compute-dtype shard is that slice, not a second copy (DeepSpeed's stages 1 and 2 do the
    # same: the bf16 partitions are views of the flat bf16 params). refresh_shards writes the
    # stepped masters into it, and the Refresh that follows gathers the others' slices around
    # it. A param split with padding keeps its shard apart on every rank (the last rank's shard
    # runs past the value), so every rank holds the same bytes, as fz3.plan counts them. Should
    # the param be freed all the same, the slice keeps that buffer alive as the shard (the pool
    # takes no buffer that still has users), and the next gather replaces it.

    def free(self, p: int) -> None:
        """Param p becomes NOT_AVAILABLE: only the shard stays (DeepSpeed: partition()). Its
        .data is empty, so a read of it fails loudly; but a param in `grad_due` (freed before
        autograd accumulates its grad: [Note: backward reads no param], engine.py) keeps its
        shape over one element, which AccumulateGrad needs, until `grad_in`: a NaN, so that a
        read fz3 could not see (the weight reached past its module) is loud too."""
        self.free_many((p,))

    def free_many(self, ps: Iterable[int]) -> None:
        """`free` of each of `ps` (a Free's params), in one loop."""
        params, full, due = self.params, self.full, self.grad_due
        for p in ps:
            params[p].data = self._nan.expand(self.shapes[p]) if p in due else self._empty
            if full[p] is not None:
                self._forget(p)

    def rewritten(self, ps) -> None:
        """The full values of `ps` were written in place (effects.Refresh): the params' version
        counters move, so a graph saved before the step and backwarded after it fails loudly, as
        torch's own optimizer step makes it, instead of reading the new values. The writes went
        through views of the buffers, which move the buffers' counters, not the params'."""
        torch.autograd.graph.increment_version([self.params[p] for p in ps])

    def zero_grad(self, p: int) -> None:
        """param.grad = zeros of p's shape, gathered or not: torch checks a grad against .data's
        shape, and a freed param's .data is empty, so its shape is lent for the assignment."""
        param = self.params[p]
        data = param.data
        param.data = self._empty.new_empty(()).expand(self.shapes[p])
        param.grad = torch.zeros(self.shapes[p], dtype=self.dtype, device=self.device)
        param.data = data

    def grad_in(self, p: int) -> None:
        """Param p's grad was accumulated: if it is freed, its .data becomes empty again."""
        if p in self.grad_due:
            self.grad_due.discard(p)
            if self.full[p] is None:  # freed: the shape-keeping placeholder goes
                self.params[p].data = self._empty

    def clear_grad_due(self) -> None:
        """The backward is over, or never came: no freed param keeps a placeholder."""
        for p in list(self.grad_due):
            self.grad_in(p)

    def _forget(self, p: int) -> None:
        flat, self.full[p] = self.full[p], None
        if flat is not None:
            key = self.full_key[p]  # its storage, as set_fulls found it
            spans = [s for s in self.full_spans[key] if s[2] != p]
            if spans:
                self.full_spans[key] = spans
            else:
                del self.full_spans[key]

    def full_of(self, t: torch.Tensor) -> tuple[int, int] | None:
        """(param, offset of t in its full value) if t lies in a gathered param's full value."""
        spans = self.full_spans.get(_storage(t))
        if spans is not None:
            off = t.storage_offset()
            for start, n, p in spans:
                if start <= off < start + n:
                    return p, off - start
        return None

    def free_partitions(self) -> None:
        """Give the grad partitions' memory back (the views stay, unreadable until
        `ensure_partitions`); the masters lose their .grad so nothing reads freed memory."""
        for m in self.masters:
            m.grad = None
        for seg in self.segments:
            seg.grads.untyped_storage().resize_(0)

    def ensure_partitions(self, params: Iterable[int] | None = None) -> None:
        """Memory for the grad partitions of `params` (None: all) again, contents undefined (the
        window's first write of each is a copy, and the rest get ZeroPartitions). A segment's
        memory comes with its first param's write: through a backward, the partitions grow as
        the gathered params it frees shrink, instead of all of them coming at the first reduce."""
        segments = self.segments if params is None else {self.segments[self.segment_of[p]] for p in params
                                                         if self.segment_of[p] >= 0}
        for seg in segments:
            storage = seg.grads.untyped_storage()
            if storage.nbytes() == 0 and seg.grads.numel():
                storage.resize_(seg.grads.numel() * seg.grads.element_size())
                if self.huge_pages:
                    advise_huge(seg.grads)

    def segment_grads(self) -> list[torch.Tensor]:
        """Every segment's grad partitions, flat (what the average, the norm and clipping walk)."""
        return [seg.grads for seg in self.segments]

    def grad_bytes(self) -> int:
        """Bytes of grad partitions this rank holds now."""
        return sum(g.untyped_storage().nbytes() for g in self.segment_grads())

    def bind_grads(self, no_grad: tuple[int, ...] = ()) -> None:
        """The optimizer reads masters[p].grad: each trainable master's partition (re-bound after
        a user's zero_grad set it None), but None for the params of `no_grad`, which no grad
        reached in the window, so no optimizer steps them ([Note: no grad, no step])."""
        for m, part, host in zip(self.masters, self.partitions, self.host_partitions):
            if part is not None:
                m.grad = part if host is None else host
        for p in no_grad:
            self.masters[p].grad = None

    def write_full(self, p: int, full: torch.Tensor) -> None:
        """Take a new full value of param p (gathered_parameters with a modifier rank)."""
        shard = layout.shard_of(full.detach().to(torch.float32).reshape(-1), self.rank, self.world_size)
        self.masters[p].data.copy_(shard)
        if self.separate:
            self.shards[p].copy_(self.masters[p].detach())

    def shard_bytes(self) -> dict[str, int]:
        """Bytes this rank holds: fp32 masters, compute shards (if separate), grad partitions
        (0 between an optimizer step and the next window's first write)."""
        master = sum(m.numel() for m in self.masters) * 4
        compute = 0 if not self.separate else sum(
            s.numel() * s.element_size() for s in self.shards if self.full_of(s) is None)  # not in a full value
        return {"param_shards": master + compute, "grad_partitions": self.grad_bytes()}


class Segment(NamedTuple):
    """Whole params of one run, side by side: their grad partitions are one tensor with a
    storage of its own, allocated at its first write in a window (`ensure_partitions`), and
    the optimizer steps their masters as one flat chunk ([Note: flat steps])."""

    run: int
    start: int  # where its first master lies in its run, counting the run's masters in order
    params: tuple[int, ...]
    grads: torch.Tensor  # their partitions, flat
    masters: torch.Tensor  # their fp32 masters, flat (what the optimizer steps as one chunk)
    host_grads: torch.Tensor | None = None  # the grads' copy in host memory (TensorStore `host`)


MIN_SEGMENT = 1 << 16  # a segment holds whole shards up to max(this, its run's largest shard) elements


def _cut(run: tuple[int, ...], sizes: list[int], limit: int | None = None) -> list[tuple[int, ...]]:
    """A run's params in segments of whole params, each up to `limit`, by default max(MIN_SEGMENT,
    the run's largest shard) elements: the flat step's temporaries stay the size they were
    stepping shard by shard (give or take 512 KiB), and a backward allocates its grads a segment
    at a time."""
    limit = max([MIN_SEGMENT] + sizes) if limit is None else limit
    return [tuple(run[i] for i in seg) for seg in consecutive_runs(sizes, limit)]


def consecutive_runs(sizes: Sequence[int], limit: int) -> list[tuple[int, ...]]:
    """Indices of `sizes` cut into runs of consecutive ones totalling at most `limit` each (one
    larger than `limit` alone), a run closed when the next would overflow it."""
    out, run, total = [], [], 0
    for i, n in enumerate(sizes):
        if run and total + n > limit:
            out.append(tuple(run))
            run, total = [], 0
        run.append(i)
        total += n
    if run:
        out.append(tuple(run))
    return out


def _complete_runs(runs: Sequence[Sequence[int]], trainable: list[bool]) -> list[tuple[int, ...]]:
    """`runs` checked (trainable ParamIds, each in one run at most), and the trainable params in
    none of them after, as one more run in id order (if any)."""
    seen: set[int] = set()
    out = []
    for run in runs:
        for p in run:
            if not 0 <= p < len(trainable) or not trainable[p] or p in seen:
                raise ValueError(f"TensorStore runs: ParamId {p} is out of range, frozen or in two runs")
            seen.add(p)
        out.append(tuple(run))
    rest = tuple(p for p, t in enumerate(trainable) if t and p not in seen)
    return out + [rest] if rest else out  # run i is still the caller's i, empty or not


def _storage(t: torch.Tensor) -> int:
    """The storage `t` lies in, as a key: meta tensors (fz3.plan) have no data_ptr."""
    return t.untyped_storage()._cdata
