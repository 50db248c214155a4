"""Effects: small frozen records describing data-plane work. The core returns them; interpreters
(the real torch.distributed one, the recorder, the simulated world) carry them out.

Pure data: printable, comparable, hashable. Every rank computes the same effects in the same
order (I6), so the collectives they describe line up across ranks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple, Union

from fz3.core.ids import BucketId, Handle, ParamId

# ---- parameter lifecycle -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AllGather:
    """Start one flat all-gather of these params' shards (sorted by id) as in-flight `handle`.

    Afterwards the params are INFLIGHT: nobody may read them before `Wait(handle)`.
    DeepSpeed: `all_gather_coalesced` on the allgather stream.
    """

    handle: Handle
    params: tuple[ParamId, ...]
    prefetch: bool  # issued ahead of need from the trace (not for the module being fetched)
    forward: bool  # forward or backward phase (counter labels only)


@dataclass(frozen=True, slots=True)
class Wait:
    """Block until the gather `handle` is done; its params become AVAILABLE.

    On a device: the compute stream waits on the gather stream (no host sync).
    """

    handle: Handle


@dataclass(frozen=True, slots=True)
class Free:
    """Drop these params' full values; only the shards stay. DeepSpeed: `partition()`."""

    params: tuple[ParamId, ...]


# ---- gradient lifecycle --------------------------------------------------------------------
# The IPG bucket's life, per comm dtype (see fz3/core/grads.py for the diagram):
#   CopyToBucket* -> ReduceBucket -> WritePartition (copy | add) per slot -> DropGrads
# and per backward: WaitReduce; at the accumulation boundary: ZeroPartitions, AverageGrads.

WriteMode = Literal["copy", "add"]
COPY: WriteMode = "copy"  # first write of this param's partition in the accumulation window
ADD: WriteMode = "add"  # a later write in the same window

ReducePath = Literal["allreduce", "reduce_scatter"]  # Config.reduce_path


class Slot(NamedTuple):
    """One grad's place in the flat IPG bucket: elements [offset, offset + numel)."""

    param: ParamId
    offset: int
    numel: int


@dataclass(frozen=True, slots=True)
class CopyToBucket:
    """Copy `param`'s full grad into the flat IPG bucket of `dtype` at [offset, offset + numel).

    Only with contiguous_gradients; the bucket holds the grad until `DropGrads(bucket)`, and
    param.grad is released (None) after the copy, so a later accumulation into it (a new graph
    task under reentrant checkpointing) starts from a fresh grad.
    DeepSpeed: `__add_grad_to_ipg_bucket` (it makes param.grad a view of the bucket instead,
    which lets a later AccumulateGrad add into a bucket already reduced).
    """

    bucket: BucketId
    dtype: str
    param: ParamId
    offset: int
    numel: int


@dataclass(frozen=True, slots=True)
class ReduceBucket:
    """SUM-reduce the bucket's grads across ranks on `path`; each rank keeps its partitions.

    allreduce: all-reduce the flat bucket, then each slot's [r*s, (r+1)*s) clipped to numel and
    zero-padded to s. reduce_scatter: one reduce-scatter of the padded grads, interleaved per
    rank in ParamId order. Both give the same partitions (I3). `contiguous`: the grads sit in
    the flat bucket (CopyToBucket); False: read from each param's own grad (contiguous_gradients
    off, or one grad bigger than the whole bucket). Runs on the reduce stream with overlap_comm.
    DeepSpeed: `__reduce_and_partition_ipg_grads` (without its pre-division: fz3 sums, then
    divides once in AverageGrads).
    """

    bucket: BucketId
    dtype: str
    path: ReducePath
    slots: tuple[Slot, ...]  # in bucket (offset) order
    contiguous: bool


@dataclass(frozen=True, slots=True)
class WritePartition:
    """Write this rank's reduced slice of `param` (from `bucket`) into its grad partition.

    copy on the first write in the accumulation window, add on later ones.
    DeepSpeed: `partition_grads` (copy_ when micro_step_id == 0, else add_).
    """

    bucket: BucketId
    param: ParamId
    mode: WriteMode


@dataclass(frozen=True, slots=True)
class DropGrads:
    """The bucket's full grads are consumed: its buffer is free again.

    `contiguous`: the grads lived in the flat bucket (param.grad was released at the copy);
    False: they are the params' own grads, so set each param.grad to None.
    """

    bucket: BucketId
    params: tuple[ParamId, ...]
    contiguous: bool


@dataclass(frozen=True, slots=True)
class WaitReduce:
    """The compute stream waits for the reduce stream: every reduce and write so far is done.

    DeepSpeed: the reduce-stream synchronize in `independent_gradient_partition_epilogue`.
    """


@dataclass(frozen=True, slots=True)
class ZeroPartitions:
    """Fill these params' grad partitions with zeros: they got no grad in this window."""

    params: tuple[ParamId, ...]


@dataclass(frozen=True, slots=True)
class AverageGrads:
    """Divide every grad partition by `divisor` (= world size x gradient_accumulation_steps).

    Partitions then hold the mean gradient; the optimizer reads them in place (views, no copy).
    One division of the exact sum, never the backend's AVG (gloo's is wrong, HCCL emulates it).
    DeepSpeed: `averaged_gradients` in `independent_gradient_partition_epilogue`.
    """

    divisor: int


GradEffect = Union[CopyToBucket, ReduceBucket, WritePartition, DropGrads, WaitReduce,
                   ZeroPartitions, AverageGrads]
