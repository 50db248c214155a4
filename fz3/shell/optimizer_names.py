"""The names DeepSpeed scripts read off the optimizer deepspeed.initialize returns.

    optimizer.loss_scale, optimizer.cur_scale   the loss scale (fp16; 1.0 otherwise)
                                                (BEiT-style scripts, Megatron-DeepSpeed)
    optimizer.overflow                          the last boundary's step was skipped
                                                (Accelerate's DeepSpeedOptimizerWrapper.step_was_skipped)

fz3 hands back the user's own torch optimizer (its param groups rebound to the fp32 master
shards, fz3/shell/optim.py), where DeepSpeed hands back its ZeRO optimizer, which carries these
three. The optimizer object fz3 was given becomes an instance of a subclass of its own class
that adds them as read-only properties over the engine: isinstance, its methods and its state
are untouched, and no other object or class in the process changes. Values as DeepSpeed 0.19.8
gives them (tests/data/deepspeed_stages_0.19.8.json): the scale is 1.0 outside fp16, and
`overflow` stays True from a skipped step to the next boundary, in fp32 and bf16 too.
"""
from __future__ import annotations

import functools
import weakref

import torch


_ENGINES: "weakref.WeakKeyDictionary[torch.optim.Optimizer, weakref.ref]" = weakref.WeakKeyDictionary()


class ZeroOptimizerNames:
    """Mixed in before the user's optimizer class (`add_names`). A copy or a pickle of the
    optimizer is an instance of the user's own class again."""

    @property
    def loss_scale(self) -> float:
        return _ENGINES[self]().loss_scale.scale

    @property
    def cur_scale(self) -> float:
        return _ENGINES[self]().loss_scale.scale

    @property
    def overflow(self) -> bool:
        return _ENGINES[self]().overflow

    def __reduce_ex__(self, protocol):
        fn, args, *rest = super().__reduce_ex__(protocol)
        if args and args[0] is type(self):
            args = (type(self).__bases__[1],) + tuple(args[1:])
        return (fn, args, *rest)


@functools.lru_cache(maxsize=None)
def _with_names(cls: type) -> type:
    return type(cls.__name__, (ZeroOptimizerNames, cls), {"__module__": cls.__module__,
                                                          "__qualname__": cls.__qualname__})


def add_names(optimizer: torch.optim.Optimizer, engine) -> None:
    """Give `optimizer` DeepSpeed's three names, read off `engine` (held weakly)."""
    if any(hasattr(type(optimizer), name) for name in ("loss_scale", "cur_scale", "overflow")):
        return  # an optimizer of the user's own that has them keeps its own
    _ENGINES[optimizer] = weakref.ref(engine)
    optimizer.__class__ = _with_names(type(optimizer))
