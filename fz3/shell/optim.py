"""The user's optimizer on fp32 master shards, the global grad norm and clipping over partitions.

`bind_optimizer` rewrites each param group's "params" list in place: the model's Parameter is
replaced by its fp32 master shard (an nn.Parameter of shape (s,)), every other group setting is
kept, so any torch.optim optimizer works unchanged. DeepSpeed: the fp32 flat partitions of
`_create_fp32_partitions`; it builds its own optimizer groups, fz3 keeps the user's.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from fz3.data.store import TensorStore


class InferenceOnly(torch.optim.Optimizer):
    """The optimizer of an engine built without one, `fz3.initialize(model, None, config)`: a
    frozen, inference-only engine (a reference model beside a trained policy, a model that only
    generates). Its params are sharded and gathered as any engine's; it keeps no optimizer state,
    and no grad memory unless a backward runs through it. Its step() refuses: nothing may move
    its weights."""

    def __init__(self, params) -> None:
        super().__init__(params, {})

    def step(self, closure=None):
        raise RuntimeError("fz3: this engine was built without an optimizer (fz3.initialize(model, None, ...)): it "
                           "runs forwards (a frozen reference model, generation) and has no step; to train the model, "
                           "pass an optimizer built on model.parameters()")


def bind_optimizer(optimizer: torch.optim.Optimizer, params: list[nn.Parameter],
                   masters: list[nn.Parameter]) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"fz3.initialize expects a torch.optim.Optimizer, or None for an engine that only runs "
                        f"forwards, got {type(optimizer).__name__}")
    if optimizer.state:
        raise ValueError("fz3.initialize: the optimizer already has state (it has stepped); build it "
                         "on model.parameters() and pass it before the first step")
    master_of = {id(p): m for p, m in zip(params, masters)}
    seen = set()
    for i, group in enumerate(optimizer.param_groups):
        rebound = []
        for p in group["params"]:
            if id(p) not in master_of:
                raise ValueError(f"optimizer param group {i} holds a tensor of shape {tuple(p.shape)} "
                                 "that is not a parameter of the model")
            if id(p) in seen:
                continue  # a tied param listed twice steps once
            seen.add(id(p))
            rebound.append(master_of[id(p)])
        group["params"] = rebound


def shard_state_dict(optimizer: torch.optim.Optimizer) -> dict:
    """torch's state_dict() of the bound optimizer: this rank's state, each per-element tensor
    shaped like its master shard (s,). What fz3's checkpoints save; the user's
    optimizer.state_dict() refuses instead (fz3/io/optimizer_state.py: [Note: optimizer state of a
    sharded optimizer]), so this calls the class's own method."""
    return type(optimizer).state_dict(optimizer)


def load_shard_state_dict(optimizer: torch.optim.Optimizer, sd: dict) -> None:
    """torch's load_state_dict() of a `shard_state_dict`, past the user-facing one (which takes an
    unsharded state dict)."""
    type(optimizer).load_state_dict(optimizer, sd)


def check_scheduler(lr_scheduler, optimizer: torch.optim.Optimizer):
    """`lr_scheduler` if it can be stepped and drives `optimizer` (None passes). A scheduler
    built on another optimizer would step learning rates nobody uses, silently."""
    if lr_scheduler is None:
        return None
    if not callable(getattr(lr_scheduler, "step", None)):
        raise TypeError(f"fz3.initialize: lr_scheduler must have a step() method (a torch.optim."
                        f"lr_scheduler.LRScheduler), got {type(lr_scheduler).__name__}")
    own = getattr(lr_scheduler, "optimizer", optimizer)
    if own is not optimizer:
        raise ValueError(f"fz3.initialize: lr_scheduler {type(lr_scheduler).__name__} drives another "
                         "optimizer than the one passed; build it on that optimizer")
    return lr_scheduler


def global_grad_norm(store: TensorStore, all_reduce_sum: Callable[[torch.Tensor], torch.Tensor], *,
                     counted: bool = True) -> torch.Tensor:
    """The L2 norm of the whole averaged gradient, () fp32, the same on every rank.

    Each rank sums the squares of its partitions (padding holds zeros), one all-reduce makes the
    global sum. `counted` False: this rank's partitions are a copy of another's (stage 0: every
    rank holds the whole grad, fz3/core/stage.py), so it adds 0 and the sum counts each once.
    [Note: norm in rows] fp32 rows of ROW elements, their squared norms summed in fp64: 7 ms
    for the wide benchmark model's 14.7M-element partition, relative error ~1e-8. Every
    segment's row norms are concatenated and squared and summed at once, so the launches do
    not grow four a segment (bench/launches.py).
    Casting the whole partition to fp64 first cost 315 ms a step there (two fresh 118 MB
    temporaries, page-faulted each time); one fp32 norm of it, 1e-3 relative error.
    DeepSpeed: get_grad_norm_direct / _global_grad_norm.
    """
    norms = []  # fp32: each segment's rows, then its tail
    for flat in store.segment_grads() if counted else ():
        whole = flat.numel() // ROW * ROW
        if whole:
            norms.append(torch.linalg.vector_norm(flat[:whole].view(-1, ROW), dim=1))
        if whole < flat.numel():
            norms.append(torch.linalg.vector_norm(flat[whole:]).reshape(1))
    # squared and summed in fp64 at once: four ops whatever the number of segments
    sq = (torch.cat(norms).double().square().sum().reshape(1) if norms else
          torch.zeros(1, dtype=torch.float64, device=store.device))
    return all_reduce_sum(sq).sqrt().to(torch.float32)[0]


ROW = 4096  # elements per fp32 partial norm in global_grad_norm


def first_nonfinite(store: TensorStore, any_rank: Callable[[tuple[bool, ...]], tuple[bool, ...]]) -> int | None:
    """The first param, in model order, whose averaged grad holds a NaN or an inf on some rank
    (None: no partition does). A second pass over the partitions, run only once the norm was
    found not finite; `any_rank` ORs the flags over ranks (every rank gets the same answer)."""
    return first_flagged(tuple(part is not None and not bool(torch.isfinite(part).all()) for part in store.partitions),
                         any_rank)


def first_flagged(flags: tuple[bool, ...], any_rank: Callable[[tuple[bool, ...]], tuple[bool, ...]]) -> int | None:
    """The first ParamId flagged on some rank (`flags` by ParamId, this rank's), None if none."""
    return next((p for p, b in enumerate(any_rank(flags)) if b), None)


def clip_grad_norm(store: TensorStore, max_norm: float, norm: torch.Tensor) -> None:
    """Scale every grad partition so the global L2 norm `norm` becomes at most `max_norm`.

    Same coefficient as torch.nn.utils.clip_grad_norm_: max_norm / (norm + 1e-6), capped at 1.
    DeepSpeed: unscale_and_clip_grads.
    """
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    torch._foreach_mul_(store.segment_grads(), coef)
