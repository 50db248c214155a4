"""What fz3.check is given: build()'s two shapes, the batches and how ranks split them, the loss.

    subject = take(build)          # calls build() once; CheckInputError names what was expected
    rank_batch(batch, rank, W)     # rank's slice of a global micro-batch (dim 0)
    copies(model, n)               # fresh copies for the runs, leaf marks kept
    estimate_bytes(numel, W, K)    # the check's memory before anything is copied

build() returns one of

    (model, example_batches, loss_fn)   example_batches: a list of global micro-batches, each a
                                        tensor, a tuple / list or a dict of tensors (any pytree
                                        fz3's hooks walk); loss_fn(model, batch) -> a scalar
                                        loss tensor. `model` is the user's nn.Module: on thread
                                        ranks the same module with fz3's hooks installed
                                        (engine.module), so model.config and other attributes
                                        work; call it as model(...) inside loss_fn.
    (model, example_inputs)             one micro-batch, as fz3.plan takes it: a tuple of args
                                        (trailing ones forward does not take are targets, not
                                        passed), a dict of kwargs, or one tensor. The loss is
                                        derived from the output (`output_loss`).

[Note: how ranks split a batch] Each micro-batch is the global one: rank r of W gets rows
[r * B/W, (r + 1) * B/W) of every tensor whose dim 0 is the batch's size B (the dim 0 of its
first tensor with one), as the parity reference does (tests/support/parity.py); other leaves
(0-d tensors, tensors of another length, ints, None) go whole to every rank. A world size that
does not divide every batch's B is not run, and the report says so. Micro-step i (counting
over the whole run, every rank alike) takes example_batches[i % len(example_batches)], so
gradient accumulation consumes consecutive batches, as a data loader would.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from fz3.build.meta import has_meta
from fz3.data.shards import shard_of
from fz3.observe.plan import bind_inputs
from fz3.shell import pytree, registry
from fz3.shell.tables import mark_leaves, marked_leaf

SHAPES = "(model, example_batches, loss_fn) or (model, example_inputs)"


class CheckInputError(ValueError):
    """build(), what it returned or a setting of fz3.check is not what fz3.check takes; the
    message names what was expected (`python -m fz3 check` exits with status 2)."""


@dataclass(frozen=True)
class Subject:
    """build()'s result, checked: the model as built (never trained: runs train copies), the
    global micro-batches, and loss_fn(model, batch) -> scalar loss."""

    model: nn.Module
    batches: tuple
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    derived: bool  # built as (model, example_inputs): the loss is output_loss of the output
    rows: tuple[int, ...]  # per batch, its size B (dim 0), split among the ranks
    whole: tuple[str, ...]  # leaves every rank gets whole, described (batch 0's)


def take(build: Callable[[], tuple]) -> Subject:
    """Call build() once and check what it returned (CheckInputError: what was expected)."""
    if not callable(build):
        raise CheckInputError(f"fz3.check takes a function build() -> {SHAPES}; got {type(build).__name__}")
    try:
        got = build()
    except Exception as e:  # the user's code: say what raised, no traceback
        raise CheckInputError(f"build() raised {type(e).__name__}: {e}") from e
    if not (isinstance(got, (tuple, list)) and len(got) in (2, 3) and isinstance(got[0], nn.Module)):
        what = f"a tuple of {len(got)}" if isinstance(got, (tuple, list)) else type(got).__name__
        first = f" whose first item is a {type(got[0]).__name__}" if isinstance(got, (tuple, list)) and got else ""
        raise CheckInputError(f"build() must return {SHAPES}, the first an nn.Module; got {what}{first}")
    model = got[0]
    if len(got) == 3:
        batches, loss_fn, derived = got[1], got[2], False
        if not isinstance(batches, (list, tuple)) or not batches:
            raise CheckInputError(f"build()'s example_batches must be a non-empty list of global micro-batches "
                                  f"(each a tensor, a tuple or a dict of tensors); got {_kind(batches)}")
        if not callable(loss_fn):
            raise CheckInputError(f"build()'s loss_fn must be callable as loss_fn(model, batch) -> scalar loss; "
                                  f"got {type(loss_fn).__name__}")
        batches = tuple(batches)
    else:
        try:
            args, kwargs = bind_inputs(model, got[1], caller="fz3.check")
        except TypeError as e:
            raise CheckInputError(str(e)) from None
        batches, loss_fn, derived = ((args, kwargs),), _derived_loss, True
    rows = tuple(_rows(b, i) for i, b in enumerate(batches))
    return Subject(model, batches, loss_fn, derived, rows, _whole(batches[0], rows[0]))


def _kind(x: object) -> str:
    return "an empty list" if isinstance(x, (list, tuple)) else type(x).__name__


def _rows(batch, i: int) -> int:
    """B: dim 0 of the batch's first tensor that has one."""
    tensors = [x for x in pytree.flatten(batch)[0] if isinstance(x, torch.Tensor)]
    for x in tensors:
        if x.device.type != "cpu":
            raise CheckInputError(f"example batch {i} holds a tensor on {x.device}; fz3.check runs on the CPU: "
                                  "build the batches there")
    for x in tensors:
        if x.dim() >= 1:
            if x.shape[0] < 1:
                raise CheckInputError(f"example batch {i} has 0 rows (its first tensor is {tuple(x.shape)})")
            return x.shape[0]
    raise CheckInputError(f"example batch {i} holds no tensor with a dim 0 to split among ranks "
                          f"(a batch is a tensor, a tuple or a dict of tensors); got {type(batch).__name__}")


def _whole(batch, rows: int) -> tuple[str, ...]:
    leaves = pytree.flatten(batch)[0]
    return tuple(f"leaf {i} ({tuple(x.shape)})" for i, x in enumerate(leaves)
                 if isinstance(x, torch.Tensor) and (x.dim() == 0 or x.shape[0] != rows))


def divides(subject: Subject, world_size: int) -> bool:
    return all(b % world_size == 0 for b in subject.rows)


def rank_batch(batch, rows: int, rank: int, world_size: int):
    """Rank's slice of a global micro-batch ([Note: how ranks split a batch]), copied, so a loss_fn
    that writes into its batch changes nothing another run sees."""
    n = rows // world_size
    leaves, spec = pytree.flatten(batch)
    out = [x[rank * n:(rank + 1) * n].clone() if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == rows
           else x.clone() if isinstance(x, torch.Tensor) else x for x in leaves]
    return pytree.unflatten(spec, out)


def _derived_loss(model: nn.Module, batch) -> torch.Tensor:
    args, kwargs = batch
    return output_loss(model(*args, **kwargs))


def output_loss(out) -> torch.Tensor:
    """The loss of (model, example_inputs): the output's `.loss` (Hugging Face; or a "loss" key),
    a one-element output itself, else the sum over the output's floating tensors that require
    grad of each one's mean (a mean, so each rank's loss is the mean over its own rows, as the
    reference's arithmetic assumes: tests/support/parity.py [Note: the reference])."""
    if isinstance(out, torch.Tensor) and out.numel() == 1:
        return out
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    floats = [x for x in pytree.flatten(out)[0]
              if isinstance(x, torch.Tensor) and x.is_floating_point() and x.requires_grad]
    if not floats:
        raise CheckInputError("the model's output has no .loss and no floating tensor that requires grad, so "
                              "there is no loss to train on: return (model, example_batches, loss_fn) instead")
    return sum(x.float().mean() for x in floats)


def check_model(model: nn.Module) -> None:
    """The model can be trained here: real fp32 values on the CPU, not yet sharded, something to train."""
    if has_meta(model):
        raise CheckInputError("the model is on the meta device (no values); fz3.check trains it, so build it on the "
                              "CPU (for a model too big for that: python -m fz3 plan, fz3.plan)")
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.device.type != "cpu":
            raise CheckInputError(f"the model's {name!r} is on {t.device}; fz3.check runs its ranks as CPU threads "
                                  "of this process: build the model on the CPU")
    if registry.managed(model.parameters()) is not None or any(shard_of(p) is not None for p in model.parameters()):
        raise CheckInputError("the model is already sharded (fz3.initialize or fz3.Init); build() must return a "
                              "plain model, built without fz3.Init")
    for name, p in model.named_parameters():
        if p.is_floating_point() and p.dtype != torch.float32:
            raise CheckInputError(f"the model's param {name!r} is {p.dtype}: fz3 keeps fp32 master shards and "
                                  "computes in Config.compute_dtype ('fp32' or 'bf16'), so build the model in fp32 "
                                  "(for bf16 compute: compute_dtype='bf16' in the config, or --bf16 to draw it)")
    if not any(p.requires_grad for p in model.parameters()):
        raise CheckInputError("the model has no parameter that requires grad: nothing to train or check")


def check_loss(loss: object, where: str) -> None:
    if not isinstance(loss, torch.Tensor):
        raise CheckInputError(f"{where} returned a {type(loss).__name__}; expected a scalar loss tensor")
    if loss.numel() != 1 or not loss.is_floating_point():
        raise CheckInputError(f"{where} returned a {loss.dtype} tensor of shape {tuple(loss.shape)}; expected a "
                              "scalar floating loss")
    if not loss.requires_grad:
        raise CheckInputError(f"{where} returned a loss that does not require grad (detached, or computed under "
                              "torch.no_grad): there is nothing to backpropagate")


def loss_backward(loss_fn: Callable, model: nn.Module, batch: Any, how: str, failure: str) -> torch.Tensor:
    """`loss_fn(model, batch)`, checked to be a scalar loss (`how` names the call), and its
    backward; any other error is a CheckInputError: `failure`, then the error. -> the loss."""
    try:
        loss = loss_fn(model, batch)
        check_loss(loss, how)
        loss.backward()
    except CheckInputError:
        raise
    except Exception as e:
        raise CheckInputError(f"{failure} {type(e).__name__}: {e}") from e
    return loss


def unique_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(first name, param) of every distinct param, in named_parameters() order."""
    return list(model.named_parameters())


def numels(model: nn.Module) -> list[int]:
    return [p.numel() for _, p in unique_params(model)]


def copies(model: nn.Module, n: int) -> list[nn.Module]:
    """n deep copies of `model`; a module fz3.set_leaf_modules marked stays marked in each."""
    out = []
    leaves = [m for m in model.modules() if marked_leaf(m)]
    for _ in range(n):
        memo: dict = {}
        try:
            twin = copy.deepcopy(model, memo)
        except Exception as e:
            raise CheckInputError(f"fz3.check trains a fresh copy of the model for each run, and "
                                  f"copy.deepcopy(model) raised {type(e).__name__}: {e}") from e
        mark_leaves(memo[id(m)] for m in leaves if id(m) in memo)
        out.append(twin)
    return out


FP32 = 4  # bytes


def estimate_bytes(numel: int, world_size: int, steps: int, references: int) -> int:
    """Bytes the check holds at most for a model of `numel` params on `world_size` ranks:
    the model as built (1); a reference's params, grads, summed grads and two optimizer states
    (5; a bf16 run adds its fp32 masters, within the margin of the next term); every rank's
    copy before it is sharded and its gathered params (2 W, everything persistent); the shards
    of all ranks: fp32 masters, grad partitions, two optimizer states (4); the params before a
    slice, to see writes outside autograd (1); the params after each step, rank 0's (K) and
    those of each of `references` references kept (K each). Activations are not counted."""
    units = 1 + 5 + 2 * world_size + 4 + 1 + steps * (1 + references)
    return FP32 * numel * units
