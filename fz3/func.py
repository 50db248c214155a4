"""ZeRO-3 as one pure function: the executable specification and the oracle for the shell.

N ranks are simulated in one process, the way JAX states FSDP with shard_map: every tensor that
differs per rank carries a leading rank axis W, and per-rank work is a `torch.func.vmap` over it.

    master shards  {name: (W, s)} fp32        (a pytree; rank r owns row r, padded with zeros)
      | gather: one all-gather of every rank's shards, padding dropped; cast to compute dtype
      v
    full params    {name: (W, *shape)}        (every rank holds the same values)
      | per micro-step m: vmap over ranks of grad(loss(functional_call(model, full_r, x_r), y_r))
      v
    full grads     {name: (W, *shape)}        (each rank's grads of its own micro-batch)
      | reduce (SUM over ranks; allreduce + own slice, or reduce-scatter) -> partitions (W, s)
      | write: copy at m = 0, add later; after the last micro-step: / (W * gas), to fp32
      v
    mean grad partitions {name: (W, s)} fp32  --SGD: shard - lr * grad-->  new master shards

`reference_step` is the same step without ZeRO: one process, full params, each micro-step's
global batch (all ranks' samples), grads summed over micro-steps, then one division.

[Note: exactness] With per-sample SUM losses, small-integer params and data, and an lr that is
a power of two, every value in a step is a dyadic rational of few bits, which fp32 represents
exactly; then the order of the sums (per rank then across ranks, or all at once) cannot change
a bit, and `train_step` equals `reference_step` under torch.equal. The one division by W * gas
is exact when the grads are multiples of it: tests/test_func.py scales its loss by W * gas so
that this holds for every step, and checks that an fp64 reference gives the same bits.
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

import optree
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from fz3.core.effects import ADD, COPY, ReducePath
from fz3.data import collectives, layout, partition

Tree = dict[str, torch.Tensor]  # name -> tensor, in the model's parameter order (= ParamId)
Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets), each (W, B, ...) or (B, ...)
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def shard_params(params: Mapping[str, torch.Tensor], world_size: int) -> Tree:
    """Full params -> fp32 master shards {name: (W, s)}."""
    return optree.tree_map(lambda p: partition.to_master(layout.shard(p.detach(), world_size)),
                           dict(params))


def gather_params(shards: Tree, shapes: Mapping[str, torch.Size], dtype: torch.dtype) -> Tree:
    """Master shards -> every rank's full params {name: (W, *shape)}, via one all-gather."""
    names = list(shards)
    world = collectives.gather_world([[shards[n][r].to(dtype) for n in names]
                                      for r in range(next(iter(shards.values())).shape[0])],
                                     [shapes[n].numel() for n in names])
    return {n: torch.stack([full[i] for full in world]).reshape(-1, *shapes[n])
            for i, n in enumerate(names)}


def rank_grads(model: nn.Module, full: Tree, batch: Batch, loss_fn: LossFn) -> Tree:
    """Each rank's grads of its loss on its micro-batch: vmap over the rank axis of `grad`."""
    def loss(params: Tree, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return loss_fn(functional_call(model, params, (x,)), y)

    return vmap(grad(loss))(full, *batch)


def reduce_to_partitions(grads: Tree, path: ReducePath) -> Tree:
    """Full grads {name: (W, *shape)} -> SUM-reduced partitions {name: (W, s)}: one bucket."""
    names = list(grads)
    w = next(iter(grads.values())).shape[0]
    parts = collectives.reduce_world([[grads[n][r] for n in names] for r in range(w)], path)
    return {n: torch.stack([p[i] for p in parts]) for i, n in enumerate(names)}


def train_step(model: nn.Module, shards: Tree, micro_batches: Sequence[Batch], *,
               loss_fn: LossFn, lr: float, path: ReducePath = "reduce_scatter",
               compute_dtype: torch.dtype = torch.float32) -> tuple[Tree, Tree]:
    """One optimizer step of ZeRO-3 on W simulated ranks -> (new master shards, mean grads).

    micro_batches[m] = (x, y) with a leading rank axis: rank r trains on x[r], y[r].
    """
    shapes = {n: p.shape for n, p in model.named_parameters()}
    full = gather_params(shards, shapes, compute_dtype)  # compute params, all ranks
    if not micro_batches:
        raise ValueError("train_step needs at least one micro-batch")
    acc: Tree = {}
    for m, batch in enumerate(micro_batches):
        batch = optree.tree_map(lambda t: t.to(compute_dtype) if t.is_floating_point() else t,
                                batch)  # inputs in the compute dtype, as the params
        reduced = reduce_to_partitions(rank_grads(model, full, batch, loss_fn), path)
        mode = COPY if m == 0 else ADD  # first write in the window, then accumulate
        acc = {n: partition.write_partition(acc.get(n), reduced[n], mode) for n in reduced}
    divisor = next(iter(shards.values())).shape[0] * len(micro_batches)
    mean = optree.tree_map(lambda g: partition.to_master(partition.average(g, divisor)), acc)
    return optree.tree_map(lambda s, g: s - lr * g, shards, mean), mean


def reference_step(model: nn.Module, params: Tree, micro_batches: Sequence[Batch], *,
                   loss_fn: LossFn, lr: float) -> tuple[Tree, Tree]:
    """The same step in one process without ZeRO -> (new params, mean grads)."""
    def loss(p: Tree, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return loss_fn(functional_call(model, p, (x,)), y)

    if not micro_batches:
        raise ValueError("reference_step needs at least one micro-batch")
    total: Tree = {}
    for x, y in micro_batches:
        g = grad(loss)(params, x.flatten(0, 1), y.flatten(0, 1))  # all ranks' samples at once
        total = g if not total else optree.tree_map(torch.add, total, g)
    divisor = micro_batches[0][0].shape[0] * len(micro_batches)
    mean = optree.tree_map(lambda g: g / divisor, total)
    return optree.tree_map(lambda p, g: p - lr * g, params, mean), mean


def unshard_params(shards: Tree, shapes: Mapping[str, torch.Size]) -> Tree:
    """Master shards -> full params {name: (*shape)} (what `engine.full_state_dict` returns)."""
    return {n: layout.unshard(s, shapes[n]) for n, s in shards.items()}
