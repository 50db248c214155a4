"""What fz3.plan guesses where the model reads data it does not have (fz3/observe/fake.py).

Each rule is (mode, func, args, kwargs) -> (output, what was guessed, in words), for an op that
FakeTensorMode cannot run without values: a scalar read (.item(), `if t:`, int(t)), or an op
whose output's shape depends on the values (nonzero, x[mask], unique, bincount).

    a bool          True: the branch that does the work (`if mask.any():`)
    an integer      1: a size that is not empty
    a float         1.0
    nonzero, x[mask], masked_select        every element True: every expert gets every token
    unique                                 every element distinct
    bincount                               the values spread evenly over the bins (a split by the
                                           counts then adds up)
    repeat_interleave(repeats)             every repeat 1
    isnan, isinf, isfinite (FINITE)        every element finite

The guesses take the branch that does the work and never make a size empty, so what runs is, if
anything, more than on real data. A guessed op's output is computed for real on a stand-in that
embodies the guess (an all-True mask, 0..n-1) where it is small, so the values the model reads
from it afterwards are exact under the guess. `mode.known(real, like)` makes such an output a
fake that keeps its value.
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils import _pytree

aten = torch.ops.aten


def scalar_rule(func):
    """Any op whose one output is a Python bool, int or float read from the data: that scalar."""
    returns = func._schema.returns
    if len(returns) == 1 and str(returns[0].type) in ("bool", "int", "float", "number"):
        return _scalar
    return None


def _scalar(mode, func, args, kwargs):
    """.item(), `if t:`, int(t), torch.equal: a bool is True, an integer 1, a float 1.0 (the
    branch that does the work, a size that is not empty)."""
    kind = str(func._schema.returns[0].type)
    t = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if kind == "bool" or (t is not None and t.dtype == torch.bool):
        return True, "True"
    if kind == "int" or (t is not None and not t.is_floating_point() and not t.is_complex()):
        return 1, "1"
    return 1.0, "1.0"


def _all_true(mode, mask: torch.Tensor) -> torch.Tensor:
    """nonzero of `mask` guessed all True: every index, known when small."""
    if mask.numel() > mode.known_numel:
        return mask.new_empty((mask.numel(), mask.dim()), dtype=torch.long)
    with unset_fake_temporarily():
        real = torch.ones(mask.shape, dtype=torch.bool).nonzero()
    return mode.known(real, mask)


def _nonzero(mode, func, args, kwargs):
    return _all_true(mode, args[0]), "every element nonzero"


def _masked_select(mode, func, args, kwargs):
    shape = torch.broadcast_shapes(args[0].shape, args[1].shape)
    return args[0].new_empty((shape.numel(),)), "every element selected"


def _bool_indices(mode, func, args, kwargs):
    """x[mask], x[mask] = v: each bool index is every index of an all-True mask."""
    indices = []
    for i in args[1]:
        if i is not None and i.dtype in (torch.bool, torch.uint8):
            indices.extend(_all_true(mode, i).unbind(1))
        else:
            indices.append(i)
    return func(args[0], indices, *args[2:], **kwargs), "every element of the mask True"


def _unique(mode, func, args, kwargs):
    """unique, unique_consecutive: every element distinct (the real op on 0..n-1)."""
    t = args[0]
    if t.numel() > mode.known_numel:
        raise RuntimeError(f"fz3.plan: {func} of {t.numel():,} elements depends on the data; the plan "
                           f"guesses it only up to {mode.known_numel:,} elements")
    with unset_fake_temporarily():
        stand_in = torch.arange(t.numel()).reshape(t.shape).to(t.dtype)
        real = func(stand_in, *args[1:], **kwargs)
    return _pytree.tree_map_only(torch.Tensor, lambda r: mode.known(r, t), real), "every element distinct"


def _bincount(mode, func, args, kwargs):
    """bincount: the values spread evenly over max(minlength, 1) bins (tokens over experts), so
    the counts sum to the input's size, as a split by them needs."""
    t, weights = args[0], (args[1] if len(args) > 1 else kwargs.get("weights"))
    minlength = args[2] if len(args) > 2 else kwargs.get("minlength", 0)
    bins = max(minlength, 1)
    with unset_fake_temporarily():
        spread = torch.arange(min(t.numel(), mode.known_numel)) % bins
        real = func(spread, None if weights is None else torch.ones(spread.shape, dtype=weights.dtype),
                    minlength)
    value = f"the values spread evenly over {bins} bins"
    if weights is not None or t.numel() > mode.known_numel:
        return t.new_empty(real.shape, dtype=real.dtype), value
    return mode.known(real, t), value


def _repeat_interleave(mode, func, args, kwargs):
    """repeat_interleave(repeats): every repeat 1, so the indices 0..n-1."""
    repeats = args[0]
    with unset_fake_temporarily():
        real = torch.arange(repeats.numel())
    return mode.known(real, repeats), "every repeat 1"


GUESSES = {aten.nonzero: _nonzero, aten.masked_select: _masked_select, aten.index: _bool_indices,
           aten.index_put: _bool_indices, aten.index_put_: _bool_indices, aten._index_put_impl_: _bool_indices,
           aten._unique2: _unique, aten._unique: _unique, aten.unique_dim: _unique,
           aten.unique_consecutive: _unique, aten.bincount: _bincount,
           aten.repeat_interleave: _repeat_interleave}
"""What each op whose output shape depends on the data is guessed to return."""


def _grouped_mm(func, args, kwargs):
    """torch's meta kernel for _grouped_mm checks CUDA's rule (bf16 only) where the cpu kernel
    takes any float (Hugging Face's MoE experts call it in fp32 on cpu): the shape from bf16
    stand-ins, the dtype the cpu kernel returns."""
    a, b = args[0], args[1]
    if a.dtype == b.dtype == torch.bfloat16:
        return func(*args, **kwargs)
    out_dtype = kwargs.pop("out_dtype", None) or a.dtype
    return func(a.to(torch.bfloat16), b.to(torch.bfloat16), *args[2:], **kwargs).to(out_dtype)


STRICTER_META = {aten._grouped_mm.default: _grouped_mm}
"""Ops whose meta kernel refuses what their cpu kernel runs, and how the plan shapes them."""
FINITE = {aten.isnan: False, aten.isinf: False, aten.isposinf: False, aten.isneginf: False, aten.isfinite: True}
"""What each elementwise finiteness test gives on a value the plan does not have: every element
finite, so a model's NaN check passes as on ordinary data (PlanFakeMode._finite)."""
