"""`with fz3.Init(): model = build()` -- build a model already sharded (DeepSpeed's zero.Init).

    with fz3.Init():                  # torch.distributed initialised first (fz3.launch.run)
        model = GPT(cfg)              # each module's params partitioned as its __init__ returns
        model.apply(custom_init)      # still inside: writes reach the shards
    engine = fz3.initialize(model, torch.optim.AdamW(model.parameters()), cfg)

How a model is built without ever being whole on a rank:
- Every nn.Module subclass's `__init__` is wrapped while the block runs (classes defined inside
  it too, through `__init_subclass__`). After the outermost `__init__` of a module returns (at
  the next module, see [Note: the last module built is closed late]), each param of its
  subtree that still holds a full value is *closed*: rank 0's value is broadcast,
  this rank keeps its shard (fz3.data.layout, the layout the engine uses) and the param's .data
  becomes a placeholder with the full shape, dtype and device over one element of storage
  (a stride-0 expand of a zero). So a rank holds its shards plus the module being built.
- [Note: values equal unsharded construction] Every rank runs the same constructors in the same
  order, so every rank draws the same random numbers as an unsharded build under the same seed;
  the broadcast from rank 0 then makes the shards agree even if ranks were seeded differently.
  Nothing else consumes random numbers, so the values are those of an unsharded build, bit for
  bit (tests/test_init.py).
- Custom init after a module is built (nanoGPT's loop over named_parameters, Hugging Face's
  `post_init`, `model.apply(fn)`) meets closed params. A torch-function mode, active for the
  whole block, *opens* a closed param that an operation touches: an in-place initializer that
  overwrites every element (`normal_`, `zero_`, `nn.init.xavier_uniform_`, ...; OVERWRITE) gets
  fresh memory, anything else (`p.mul_(2)`, `p.data`, `p[0].zero_()`, `p.sum()`) the gathered
  value (one all-gather). Open params are closed again, oldest first, when they would exceed
  OPEN_BYTES, when the next module is built, and when the block ends. Shape, dtype and device
  queries never open anything.
- The placeholders' storage is one element: outside the block an in-place write to such a param
  fails loudly (torch refuses to write overlapping memory) and a read sees zeros. Touch params
  inside the block, or after `fz3.initialize` with `fz3.gathered_parameters`.

Every rank must run the same code inside the block: closing and opening are collectives.
Modules built on the `meta` device are left alone (fz3.initialize materializes those).
DeepSpeed: deepspeed.zero.Init (partition_parameters.py), which broadcasts from rank 0 too but
skips custom init done after a module is built (docs/environment.md).
"""
from __future__ import annotations

import contextlib
import functools
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils._pytree import tree_leaves

from fz3.core.spec import shard_numel
from fz3.data import layout, shards
from fz3.data.shards import Shard, shard_of
from fz3.data.collectives import ALL_GATHER
from fz3.shell.pick import pick_device

OPEN_BYTES = 64 << 20
"""Bytes of opened params kept full at once, beyond the one being opened."""

OVERWRITE = frozenset(f"torch.Tensor.{m}" for m in (
    "normal_", "uniform_", "zero_", "fill_", "copy_", "random_", "exponential_", "geometric_",
    "log_normal_", "cauchy_", "bernoulli_")) | frozenset(f"torch.nn.init.{f}" for f in (
        "normal_", "uniform_", "zeros_", "ones_", "constant_", "trunc_normal_", "xavier_uniform_",
        "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "eye_", "dirac_",
        "sparse_"))
"""Operations that write every element of their first argument, reading none of it."""

METADATA = frozenset(f"torch.Tensor.{a}" for a in (
    "size", "dim", "ndimension", "numel", "nelement", "element_size", "is_floating_point",
    "is_complex", "is_signed", "stride", "is_contiguous", "requires_grad_", "__hash__", "__len__",
    *(f"{g}.__get__" for g in ("shape", "ndim", "dtype", "device", "layout", "requires_grad",
                               "is_leaf", "grad", "grad_fn", "is_cuda", "is_cpu", "is_meta",
                               "is_sparse", "is_quantized", "is_nested", "names", "itemsize",
                               "nbytes", "_base", "output_nr")),
    "requires_grad.__set__", "grad.__set__"))
"""Questions about a param that its placeholder answers as the full value would."""


_ACTIVE: list["Init"] = []  # the Init blocks entered, innermost last
_WRAPPED: dict[type, object] = {}  # class -> its own __init__ before wrapping


class Init:
    """Build modules already sharded over `group` (the default process group if None). Nested
    blocks are one. `enabled=False` does nothing (DeepSpeed's `zero.Init(enabled=...)`)."""

    def __init__(self, enabled: bool = True, *, group=None) -> None:
        self.enabled, self.group = enabled, group
        self.mode: _Mode | None = None
        self.depth: dict[int, int] = {}  # id(module) -> __init__ calls of it running
        self.built: list[weakref.ref] = []  # modules whose __init__ returned inside the block
        self.open: dict[int, nn.Parameter] = {}  # id -> param opened, oldest first
        self.due: list[weakref.ref] = []  # the last module built: its params, closed late
        self.busy = False  # fz3's own tensor work: the mode lets it through

    def __enter__(self) -> "Init":
        if not self.enabled:
            return self
        if _ACTIVE:  # an inner block: the outer one does the work
            _ACTIVE.append(self)
            return self
        self.join_group()
        _ACTIVE.append(self)
        _wrap_all()
        self.mode = _Mode(self)
        self.mode.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.enabled:
            return
        _ACTIVE.pop()
        if self.mode is None:  # an inner block of an outer one
            return
        self.mode.__exit__(exc_type, exc, tb)
        _unwrap_all()
        if exc_type is None:  # after an error ranks may be anywhere: no collectives
            self.close_due()
            self.close_all()
            for ref in self.built:
                module = ref()
                for p in self.new_params(module) if module is not None else ():
                    self.close(p)

    def join_group(self) -> None:
        if not dist.is_initialized():
            raise RuntimeError("fz3.Init needs torch.distributed initialised first (fz3.launch.run, or "
                               "torchrun + fz3.launch.init_from_env): every rank keeps its shard")
        self.rank, self.world_size = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        self.comm_device = pick_device().torch_device

    # ---- module construction ------------------------------------------------------------------

    def init_started(self, module: nn.Module) -> None:
        if id(module) not in self.depth:
            self.close_due()  # a new module begins: the one built before it is closed first
        self.depth[id(module)] = self.depth.get(id(module), 0) + 1

    def init_returned(self, module: nn.Module, ok: bool) -> None:
        left = self.depth.pop(id(module)) - 1
        if left:
            self.depth[id(module)] = left
        elif ok:
            self.close_due()
            self.close_all()
            self.due = [weakref.ref(p) for p in self.new_params(module)]
            self.built.append(weakref.ref(module))

    def new_params(self, module: nn.Module) -> list[nn.Parameter]:
        """The params of `module`'s subtree that hold a full value (not built on meta)."""
        with self.quiet():
            return [p for p in module.parameters() if self.unsharded(p)]

    def unsharded(self, p: nn.Parameter) -> bool:
        """p holds a full value that is neither sharded, open, nor on meta."""
        return not p.is_meta and id(p) not in self.open and shard_of(p) is None

    def close_due(self) -> None:
        """[Note: the last module built is closed late] A module's new params are closed when
        the next module starts or ends, when a closed param is opened, or when the block ends,
        not the moment its __init__ returns: a param its parent drops at once (a head's weight
        replaced by the embedding's to tie them) then dies full and is never sharded. A rank
        still holds at most one module full. 1 B GPT: construction peak 2.50 -> 2.38 GiB/rank,
        the head's 0.13 GiB shard gone (bench/diagnostics/memory.py)."""
        due, self.due = self.due, []
        with self.quiet():
            for ref in due:
                p = ref()
                if p is not None and self.unsharded(p):
                    self.close(p)

    # ---- closing and opening ------------------------------------------------------------------

    def close(self, p: nn.Parameter) -> None:
        """Keep this rank's shard of rank 0's value of `p`; its .data becomes a placeholder."""
        with self.quiet():
            self.open.pop(id(p), None)
            full = p.detach().to(self.comm_device).contiguous()  # in place when it can: the value
            if self.world_size > 1:                              # being dropped takes rank 0's
                dist.broadcast(full, src=self.src, group=self.group)
            data = layout.rank_slice_into(full.reshape(-1), self.rank, self.world_size,
                                          self._shard_memory(p, full))
            placeholder = torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape)
            shards.keep(p, Shard(data, self.rank, self.world_size, placeholder))
            p.data = placeholder

    def _shard_memory(self, p: nn.Parameter, full: torch.Tensor) -> torch.Tensor:
        """Where p's shard goes: the shard it had before it was opened, if it still fits (no
        second copy beside the full value), else new memory."""
        kept = shards.kept(p)
        s = shard_numel(full.numel(), self.world_size)
        if kept is not None:
            old = kept.data
            if old.numel() == s and old.dtype == full.dtype and old.device == full.device:
                return old
        return torch.empty(s, dtype=full.dtype, device=full.device)

    def open_param(self, p: nn.Parameter, *, overwrite: bool, keep: set[int]) -> None:
        """Give closed `p` a full value: fresh memory if the next operation overwrites it, else
        the gathered one. Older open params are closed first to stay within OPEN_BYTES."""
        shard = shard_of(p)
        nbytes = p.numel() * p.element_size()
        self.close_due()
        with self.quiet():
            held = sum(o.numel() * o.element_size() for o in self.open.values())
            for q in [q for q in self.open.values() if id(q) not in keep]:
                if held + nbytes <= OPEN_BYTES:
                    break
                held -= q.numel() * q.element_size()
                self.close(q)
            if overwrite:
                full = torch.empty(p.shape, dtype=p.dtype, device=p.device)
            else:
                rows = shard.data.new_empty((self.world_size, shard.data.numel()))  # (W, s)
                ALL_GATHER(rows.view(-1), shard.data.contiguous(), group=self.group)
                full = layout.unshard(rows, p.shape).to(p.device)
            p.data = full
            self.open[id(p)] = p

    @contextlib.contextmanager
    def quiet(self):
        """fz3's own tensor work inside the block: the mode lets it through."""
        busy, self.busy = self.busy, True
        try:
            yield
        finally:
            self.busy = busy

    def close_all(self) -> None:
        for p in list(self.open.values()):
            self.close(p)


class _Mode(TorchFunctionMode):
    """Opens the closed params an operation touches (see the module doc)."""

    def __init__(self, init: Init) -> None:
        super().__init__()
        self.init = init
        self.names: dict[object, str] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.init.busy:
            return func(*args, **kwargs)
        closed = {id(t): t for t in tree_leaves((args, kwargs))
                  if isinstance(t, nn.Parameter) and shard_of(t) is not None}
        if closed:
            name = self.names.get(func)
            if name is None:
                name = self.names[func] = resolve_name(func) or ""
            if name not in METADATA:
                first = args[0] if args else kwargs.get("tensor")  # nn.init passes it by name
                for t in closed.values():
                    self.init.open_param(t, overwrite=t is first and name in OVERWRITE, keep=set(closed))
        return func(*args, **kwargs)


# ---- wrapping every module class's __init__ ---------------------------------------------------

def _wrap(cls: type) -> None:
    if cls in _WRAPPED or "__init__" not in cls.__dict__:
        return
    original = cls.__dict__["__init__"]
    _WRAPPED[cls] = original

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        if not _ACTIVE or _ACTIVE[0].mode is None:
            return original(self, *args, **kwargs)
        init = _ACTIVE[0]
        init.init_started(self)
        ok = False
        try:
            original(self, *args, **kwargs)
            ok = True
        finally:
            init.init_returned(self, ok)

    cls.__init__ = __init__


_SUBCLASS_HOOK: list = []  # nn.Module's own __init_subclass__ before wrapping (None: object's)


def _init_subclass(cls, **kwargs):
    before = _SUBCLASS_HOOK[0] if _SUBCLASS_HOOK else None
    if before is not None:
        before.__get__(None, cls)(**kwargs)
    else:
        super(nn.Module, cls).__init_subclass__(**kwargs)
    _wrap(cls)


def _wrap_all() -> None:
    seen, stack = set(), [nn.Module]
    while stack:
        cls = stack.pop()
        if cls in seen:
            continue
        seen.add(cls)
        _wrap(cls)
        stack.extend(cls.__subclasses__())
    _SUBCLASS_HOOK[:] = [nn.Module.__dict__.get("__init_subclass__")]
    nn.Module.__init_subclass__ = classmethod(_init_subclass)


def _unwrap_all() -> None:
    for cls, original in _WRAPPED.items():
        cls.__init__ = original
    _WRAPPED.clear()
    before = _SUBCLASS_HOOK.pop()
    if before is None:
        del nn.Module.__init_subclass__
    else:
        nn.Module.__init_subclass__ = before
