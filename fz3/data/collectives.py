"""Pack and unpack the flat buffers of ZeRO-3's collectives, and a simulated world to run them.

    gather:  rank r packs its shards (ParamId order)           -> (S,)       S = sum of s_i
             all-gather                                         -> (W*S,)     rank-major
             unpack: per param, its W shards, padding dropped   -> (n_i,) each
    reduce, allreduce path (contiguous bucket):
             pack the grads back to back at their slot offsets  -> (N,)       N = bucket fill
             all-reduce (SUM), keep each slot's rank_slice      -> (s_i,) each
    reduce, reduce_scatter path:
             for each rank r, concat over params of padded grad_i[r*s_i, (r+1)*s_i)
                                                                -> (W*S,)     rank-interleaved
             reduce-scatter (SUM): rank r gets chunk r, split   -> (s_i,) each

Both reduce paths give every rank the same partitions (I3). `sim_*` run a collective over a list
of per-rank tensors in one process (SUM; never AVG); `gather_world` / `reduce_world` run a whole
gather or reduce that way. All pure: inputs are never written.
"""
from __future__ import annotations

from itertools import accumulate
from typing import Sequence

import torch
import torch.distributed as dist

from fz3.core.effects import ReducePath
from fz3.core.spec import shard_numel
from fz3.data import layout

# torch 2.13 names the flat 1-D collectives *_single and warns on every call of the old names
ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)

Tensors = Sequence[torch.Tensor]


def pack_gather(shards: Tensors) -> torch.Tensor:
    """One rank's all-gather input: its shards (s_i,) back to back -> (S,)."""
    return torch.cat([s.reshape(-1) for s in shards]) if shards else torch.zeros(0)


def unpack_gather(gathered: torch.Tensor, numels: Sequence[int], world_size: int
                  ) -> list[torch.Tensor]:
    """The all-gather output (W*S,) -> each param's full flat value (n_i,)."""
    widths = [shard_numel(n, world_size) for n in numels]
    rows = gathered.reshape(world_size, -1)  # (W, S)
    cols = torch.split(rows, widths, dim=1)  # (W, s_i) each
    return [c.reshape(-1)[:n] for c, n in zip(cols, numels)]


def unpack_gather_into(gathered: torch.Tensor, numels: Sequence[int], world_size: int,
                       out: torch.Tensor) -> list[torch.Tensor]:
    """`unpack_gather` written into a given buffer of each param's padded full value back to
    back, (sum W * s_i,), in one op: torch.split_with_sizes_copy of the rank-major rows into
    (W, s_i) views (FSDP2's all-gather copy-out). -> views of `out`, (n_i,) each (the padding
    after them). For the interpreter, which takes `out` from its buffer pool."""
    sizes = [shard_numel(n, world_size) for n in numels]
    views, off = [], 0
    for s in sizes:
        views.append(out[off:off + world_size * s].view(world_size, s))
        off += world_size * s
    torch.split_with_sizes_copy(gathered.view(world_size, -1), sizes, dim=1, out=views)
    return [v.view(-1)[:n] for v, n in zip(views, numels)]


def padded_numel(numels: Sequence[int], world_size: int) -> int:
    """The buffer `unpack_gather_into` writes: every param's W * s_i."""
    return sum(world_size * shard_numel(n, world_size) for n in numels)


def pack_bucket(grads: Tensors) -> torch.Tensor:
    """The contiguous IPG bucket: grads flattened back to back -> (N,)."""
    return torch.cat([g.reshape(-1) for g in grads]) if grads else torch.zeros(0)


def slot_offsets(numels: Sequence[int]) -> list[int]:
    """Offsets of grads packed back to back: [0, n_0, n_0 + n_1, ...]."""
    return [0, *accumulate(numels)][:len(numels)]


def slice_allreduced(flat: torch.Tensor, slots: Sequence[tuple[int, int]], rank: int,
                     world_size: int) -> list[torch.Tensor]:
    """All-reduced bucket (N,) -> rank's partition (s_i,) of each slot (offset, numel)."""
    return [layout.rank_slice(flat[off:off + n], rank, world_size) for off, n in slots]


def pack_reduce_scatter(grads: Tensors, world_size: int) -> torch.Tensor:
    """One rank's reduce-scatter input: per rank r, the padded chunk r of every grad -> (W*S,)."""
    if not grads:
        return torch.zeros(0)
    per_rank = torch.cat([layout.shard(g, world_size) for g in grads], dim=1)  # (W, S)
    return per_rank.reshape(-1)


def pack_reduce_scatter_into(grads: Tensors, world_size: int, out: torch.Tensor) -> torch.Tensor:
    """`pack_reduce_scatter` written into a given (W*S,) buffer in one op: torch._chunk_cat cuts
    each grad into W chunks of its shard size, zero-padded, rank-major (FSDP2's reduce-scatter
    copy-in); an empty grad takes no column. For the interpreter, which reuses `out` across
    steps (a fresh buffer page-faults on every step: bench/RESULTS.md, "fz3 data-plane copies")."""
    flat = [g.reshape(-1) for g in grads if g.numel()]
    if flat:
        torch._chunk_cat(flat, dim=0, num_chunks=world_size, out=out.view(world_size, -1))
    return out


def unpack_reduce_scatter(chunk: torch.Tensor, numels: Sequence[int], world_size: int
                          ) -> list[torch.Tensor]:
    """This rank's reduce-scatter output (S,) -> its partition (s_i,) of each grad."""
    return list(torch.split(chunk, [shard_numel(n, world_size) for n in numels]))


def sim_all_gather(inputs: Tensors) -> list[torch.Tensor]:
    """Every rank receives every rank's input, rank-major."""
    out = torch.cat(list(inputs))
    return [out for _ in inputs]


def sim_all_reduce(inputs: Tensors) -> list[torch.Tensor]:
    """Every rank receives the SUM of all ranks' inputs."""
    total = torch.stack(list(inputs)).sum(0)
    return [total for _ in inputs]


def sim_reduce_scatter(inputs: Tensors) -> list[torch.Tensor]:
    """Rank r receives chunk r of the SUM of all ranks' inputs (each of length W*S)."""
    total = torch.stack(list(inputs)).sum(0)
    return list(total.reshape(len(inputs), -1).unbind(0))


def gather_world(shards: Sequence[Tensors], numels: Sequence[int]) -> list[list[torch.Tensor]]:
    """shards[r][i] (s_i,) -> per rank, every param's full flat value (n_i,), via one all-gather."""
    world_size = len(shards)
    outs = sim_all_gather([pack_gather(s) for s in shards])
    return [unpack_gather(o, numels, world_size) for o in outs]


def reduce_world(grads: Sequence[Tensors], path: ReducePath) -> list[list[torch.Tensor]]:
    """grads[r][i] (any shape) -> per rank, its SUM-reduced partition (s_i,) of every grad."""
    world_size = len(grads)
    numels = [g.numel() for g in grads[0]]
    if path == "allreduce":
        outs = sim_all_reduce([pack_bucket(g) for g in grads])
        slots = list(zip(slot_offsets(numels), numels))
        return [slice_allreduced(o, slots, r, world_size) for r, o in enumerate(outs)]
    if path == "reduce_scatter":
        outs = sim_reduce_scatter([pack_reduce_scatter(g, world_size) for g in grads])
        return [unpack_reduce_scatter(o, numels, world_size) for o in outs]
    raise ValueError(f"unknown reduce path {path!r}; expected 'allreduce' or 'reduce_scatter'")
