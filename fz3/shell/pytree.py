"""Walk a module's inputs and outputs: every structure torch can walk, dataclasses included.

    leaves, spec = flatten(tree)      leaves in a fixed order; spec rebuilds the structure
    unflatten(spec, leaves)           the same structure around (possibly replaced) leaves

The hooks need two things from a forward call's outputs (and inputs): the grad-requiring
tensors, to pass them through one PreBackward (PostBackward) node, and the parameters a module
returns, to register them as externals of its caller. A tensor the walk misses is a silent
hole: its module is never fetched again in backward ("The size of tensor a (8) must match the
size of tensor b (0)"). So the walk descends into

    tuple, list, dict                 (exact types)
    namedtuple, torch.return_types    rebuilt with their own type
    types registered with torch.utils._pytree   (OrderedDict, defaultdict, deque, Hugging Face
                                      ModelOutput, anything a library registers) with their own
                                      flatten / unflatten functions
    dataclass instances               (not registered: optree and torch's pytree treat them as
                                      leaves) every field, rebuilt by a shallow copy whose
                                      fields are set in place, so frozen and init=False fields
                                      survive
    other dict subclasses             a shallow copy with its items set

and everything else is a leaf. The registry is looked up before the dataclass and dict rules,
so a ModelOutput (an OrderedDict subclass and a dataclass) is rebuilt the way its library says.
DeepSpeed: `apply_to_tensors_only`; FSDP2: torch.utils._pytree.tree_flatten of the outputs.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from torch.utils import _pytree

Spec = Any  # None for a leaf, else (kind, type, context, child specs)

_SEQ, _DICT, _NAMEDTUPLE, _STRUCTSEQ, _REGISTERED, _DATACLASS, _DICT_SUBCLASS = range(7)


def flatten(tree: Any) -> tuple[list, Spec]:
    """-> (leaves, spec). A Tensor is always a leaf; None is a leaf (kept in place)."""
    leaves: list = []
    return leaves, _flatten(tree, leaves)


def _flatten(x: Any, leaves: list) -> Spec:
    t = type(x)
    if isinstance(x, torch.Tensor) or x is None:
        leaves.append(x)
        return None
    if t is tuple or t is list:
        return (_SEQ, t, None, [_flatten(c, leaves) for c in x])
    if t is dict:
        keys = list(x)
        return (_DICT, t, keys, [_flatten(x[k], leaves) for k in keys])
    if isinstance(x, tuple) and hasattr(t, "_fields"):
        return (_NAMEDTUPLE, t, None, [_flatten(c, leaves) for c in x])
    if isinstance(x, tuple) and hasattr(t, "n_fields"):  # torch.return_types.max, ...
        return (_STRUCTSEQ, t, None, [_flatten(c, leaves) for c in x])
    node = _pytree.SUPPORTED_NODES.get(t)
    if node is not None:
        children, context = node.flatten_fn(x)
        return (_REGISTERED, t, (node.unflatten_fn, context), [_flatten(c, leaves) for c in children])
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        names = [f.name for f in dataclasses.fields(x)]
        return (_DATACLASS, t, (x, names), [_flatten(getattr(x, n), leaves) for n in names])
    if isinstance(x, dict):
        keys = list(x)
        return (_DICT_SUBCLASS, t, (x, keys), [_flatten(x[k], leaves) for k in keys])
    leaves.append(x)
    return None


def unflatten(spec: Spec, leaves: list) -> Any:
    """The structure `spec` describes, around `leaves` (in flatten's order)."""
    it = iter(leaves)
    return _unflatten(spec, it)


def _unflatten(spec: Spec, it) -> Any:
    if spec is None:
        return next(it)
    kind, t, context, children = spec
    values = [_unflatten(c, it) for c in children]
    if kind == _SEQ:
        return t(values)
    if kind == _DICT:
        return dict(zip(context, values))
    if kind == _NAMEDTUPLE:
        return t(*values)
    if kind == _STRUCTSEQ:
        return t(values)
    if kind == _REGISTERED:
        unflatten_fn, ctx = context
        return unflatten_fn(values, ctx)
    original, names = context
    new = copy.copy(original)
    if kind == _DATACLASS:
        for n, v in zip(names, values):
            object.__setattr__(new, n, v)  # frozen dataclasses too
    else:
        for k, v in zip(names, values):
            new[k] = v
    return new
