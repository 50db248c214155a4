"""The tensor store: the only mutable tensors of fz3, one row per ParamId.

    params[p]      the user's nn.Parameter; .data is the full value while AVAILABLE, an empty
                   tensor otherwise (autograd keeps the same Parameter object throughout)
    full[p]        that full value, flat (numel,), while AVAILABLE; None otherwise
    masters[p]     fp32 shard (s,), an nn.Parameter the user's optimizer steps on
    shards[p]      compute-dtype shard (s,) the gathers read; *is* masters[p] in fp32 mode
    partitions[p]  fp32 grad partition (s,): a view of one flat buffer, also masters[p].grad
                   at the optimizer step. The buffer's memory exists from a window's first
                   write to its optimizer step (effects.FreePartitions): in between, its
                   storage is resized to 0 and the views must not be read

Sizes: s = ceil(numel / W); rank r owns flat [r*s, (r+1)*s), zero-padded (fz3/core/spec.py).
"""
from __future__ import annotations

import torch
from torch import nn

from fz3.core.spec import ModelSpec
from fz3.data import layout

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class TensorStore:
    """The shell hands it the model's params and this rank's fp32 shard of each (`shards`: from
    the Init that built them sharded, or cut from the full values), and tells it the units'
    spec and module names (`take_units`): the interpreters read them here."""

    def __init__(self, params: list[nn.Parameter], names: tuple[str, ...], shards: list[torch.Tensor], *,
                 rank: int, world_size: int, compute_dtype: str, device: torch.device) -> None:
        self.rank, self.world_size = rank, world_size
        self.dtype = DTYPES[compute_dtype]
        self.device = device
        self.params, self.names = params, names
        self.spec: ModelSpec | None = None  # the fetch units' spec, and their modules' names
        self.module_names: tuple[str, ...] = ()
        self.shapes = [p.shape for p in self.params]
        self.trainable = [p.requires_grad for p in self.params]
        self.masters: list[nn.Parameter] = [
            nn.Parameter(shard.to(device=device, dtype=torch.float32, copy=True), requires_grad=p.requires_grad)
            for p, shard in zip(params, shards)]
        self.shards: list[torch.Tensor] = []
        self.refresh_shards()
        sizes = [m.numel() if t else 0 for m, t in zip(self.masters, self.trainable)]
        self.grad_flat = torch.zeros(sum(sizes), dtype=torch.float32, device=device)
        self.partitions: list[torch.Tensor | None] = []
        offset = 0
        for n, t in zip(sizes, self.trainable):
            self.partitions.append(self.grad_flat[offset:offset + n] if t else None)
            offset += n
        self._empty = torch.empty(0, dtype=self.dtype, device=device)
        # the one element a freed param whose grad is due keeps its shape over: NaN, so a read
        # that went past fz3's hooks (a weight reached through a list, a closure) gives NaN, not
        # whatever that memory held
        self._nan = torch.full((), float("nan"), dtype=self.dtype, device=device)
        self.grad_due: set[int] = set()  # freed params whose grad autograd has yet to accumulate
        self.full_spans: dict[int, list[tuple[int, int, int]]] = {}  # storage -> (offset, numel, param)
        self.full: list[torch.Tensor | None] = [None] * len(params)
        for p in range(len(self.params)):
            self.free(p)

    def take_units(self, spec: ModelSpec, module_names: tuple[str, ...]) -> None:
        """The fetch units the interpreters serve: at initialize, and again when
        engine.compile() makes compiled blocks units."""
        self.spec, self.module_names = spec, tuple(module_names)

    def refresh_shards(self) -> None:
        """Compute-dtype shards from the fp32 masters (after each optimizer step)."""
        if self.dtype == torch.float32:
            self.shards = [m.data for m in self.masters]
        else:
            self.shards = [m.detach().to(self.dtype) for m in self.masters]

    def set_full(self, p: int, flat: torch.Tensor) -> None:
        """Param p becomes AVAILABLE: its .data is the gathered full value (numel,)."""
        self.params[p].data = flat.view(self.shapes[p])
        self._forget(p)
        self.full[p] = flat
        self.full_spans.setdefault(_storage(flat), []).append((flat.storage_offset(), flat.numel(), p))

    def free(self, p: int) -> None:
        """Param p becomes NOT_AVAILABLE: only the shard stays (DeepSpeed: partition()). Its
        .data is empty, so a read of it fails loudly; but a param in `grad_due` (freed before
        autograd accumulates its grad: [Note: backward reads no param], engine.py) keeps its
        shape over one element, which AccumulateGrad needs, until `grad_in`: a NaN, so that a
        read fz3 could not see (the weight reached past its module) is loud too."""
        if p in self.grad_due:
            self.params[p].data = self._nan.expand(self.shapes[p])
        else:
            self.params[p].data = self._empty
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
            key = _storage(flat)
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
        self.grad_flat.untyped_storage().resize_(0)

    def ensure_partitions(self) -> None:
        """Memory for the grad partitions again, contents undefined (the window's first write
        of each is a copy, and the rest get ZeroPartitions)."""
        storage = self.grad_flat.untyped_storage()
        if storage.nbytes() == 0 and self.grad_flat.numel():
            storage.resize_(self.grad_flat.numel() * self.grad_flat.element_size())

    def bind_grads(self, no_grad: tuple[int, ...] = ()) -> None:
        """The optimizer reads masters[p].grad: each trainable master's partition (re-bound after
        a user's zero_grad set it None), but None for the params of `no_grad`, which no grad
        reached in the window, so no optimizer steps them ([Note: no grad, no step])."""
        for m, part in zip(self.masters, self.partitions):
            if part is not None:
                m.grad = part
        for p in no_grad:
            self.masters[p].grad = None

    def write_full(self, p: int, full: torch.Tensor) -> None:
        """Take a new full value of param p (gathered_parameters with a modifier rank)."""
        shard = layout.shard_of(full.detach().to(torch.float32).reshape(-1), self.rank, self.world_size)
        self.masters[p].data.copy_(shard)
        if self.dtype != torch.float32:
            self.shards[p] = self.masters[p].detach().to(self.dtype)

    def shard_bytes(self) -> dict[str, int]:
        """Bytes this rank holds: fp32 masters, compute shards (if separate), grad partitions
        (0 between an optimizer step and the next window's first write)."""
        master = sum(m.numel() for m in self.masters) * 4
        compute = 0 if self.dtype == torch.float32 else sum(s.numel() for s in self.shards) * 2
        return {"param_shards": master + compute,
                "grad_partitions": self.grad_flat.untyped_storage().nbytes()}


def _storage(t: torch.Tensor) -> int:
    """The storage `t` lies in, as a key: meta tensors (fz3.plan) have no data_ptr."""
    return t.untyped_storage()._cdata
