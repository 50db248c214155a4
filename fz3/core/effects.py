"""Effects: small frozen records describing data-plane work. The core returns them; interpreters
(the real torch.distributed one, the recorder, the simulated world) carry them out.

Pure data: printable, comparable, hashable. Each is a NamedTuple (built by one tuple
construction: a frozen dataclass costs twice as much, and the core makes several per module
visit) made type-aware by `@record`: effects of different types never compare equal. Every
rank computes the same effects in the same order (I6), so the collectives they describe line up
across ranks.
"""
from __future__ import annotations

from typing import Literal, NamedTuple, Union

from fz3.core.ids import BucketId, Handle, ParamId


def record(cls):
    """Make a NamedTuple class compare and hash by type as well as by value."""
    cls.__eq__ = lambda a, b: type(a) is type(b) and tuple.__eq__(a, b)
    cls.__ne__ = lambda a, b: not a == b
    cls.__hash__ = lambda a: hash((type(a).__name__, tuple.__hash__(a)))
    return cls


# ---- parameter lifecycle -------------------------------------------------------------------


@record
class AllGather(NamedTuple):
    """Start one flat all-gather of these params' shards (sorted by id) as in-flight `handle`.

    Afterwards the params are INFLIGHT: nobody may read them before `Wait(handle)`.
    DeepSpeed: `all_gather_coalesced` on the allgather stream.
    """

    handle: Handle
    params: tuple[ParamId, ...]
    prefetch: bool  # issued ahead of need from the trace (not for the module being fetched)
    forward: bool  # forward or backward phase (counter labels only)
    secondary: tuple[ParamId, ...] = ()  # hpZ: of `params`, those gathered from their secondary
    # shards, within the hpZ group (the rest from their shards, in the shard group): [Note: hpZ],
    # fz3/core/stage.py. DeepSpeed: all_gather_coalesced's use of ds_secondary_tensor


@record
class Wait(NamedTuple):
    """Block until the gather `handle` is done; its params become AVAILABLE.

    On a device: the compute stream waits on the gather stream (no host sync).
    """

    handle: Handle


@record
class Free(NamedTuple):
    """Drop these params' full values; only the shards stay. DeepSpeed: `partition()`.

    `refetch`: they are gathered again before the pass is over (a forward release of a module
    whose backward gathers it again), so an interpreter that pools memory may keep theirs for
    that gather. Otherwise their next gather is the next pass's, and memory kept until then would
    sit idle through the backward's peak: it goes back at once.
    """

    params: tuple[ParamId, ...]
    refetch: bool = False
    secondary: tuple[ParamId, ...] = ()  # hpZ: of `params`, those whose secondary shard this rank
    # keeps first, cut from the full value ([Note: hpZ], fz3/core/stage.py). DeepSpeed:
    # _partition_param_sec


@record
class DropSecondary(NamedTuple):
    """hpZ: let these params' secondary shards go; their values are stale (the optimizer step,
    or new shards, rewrote the params). DeepSpeed: invalidate_secondary_tensor."""

    params: tuple[ParamId, ...]


@record
class Refresh(NamedTuple):
    """Gather these AVAILABLE params' shards again into the full values they already have, and
    wait: the optimizer step rewrote the shards, so the full values are stale. They stay
    AVAILABLE throughout, in the same memory (the step's refresh of the persistent params and of
    the ones an open gathered_parameters holds). An all-gather as AllGather + Wait are, but with
    nothing to take from the pool, no param to free and set again, and (p2p) the same layout
    every step: on the deep narrow GPT, ~200 persistent params, the step went from 30.1 to 24.2
    ms (bench/breakdown.py, issue #27). DeepSpeed: the all-gather of its persistent params after
    the step (_post_step).
    """

    params: tuple[ParamId, ...]


# ---- gradient lifecycle --------------------------------------------------------------------
# The IPG bucket's life, per comm dtype (see fz3/core/grad/grads.py for the diagram):
#   (CopyToBucket | HoldGrad)* -> ReduceBucket -> WritePartition (copy | add) per slot -> DropGrads
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


@record
class CopyToBucket(NamedTuple):
    """Copy `param`'s full grad into the flat IPG bucket of `dtype` at [offset, offset + numel),
    cast to `dtype` (the comm dtype, fz3.core.grad.grads.bucket_dtype) if it is another.

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


@record
class HoldGrad(NamedTuple):
    """Keep `param`'s full grad as it is (flat, cast to `dtype` if it is another) as the slot
    [offset, offset + numel) of `bucket`: the reduce reads it in place, no bucket buffer is filled.

    Emitted instead of CopyToBucket when the reduce-scatter carrier sends each grad from where it
    lies (fz3.core.grad.grads.grad_route): a copy would only stage what it sends. As with CopyToBucket,
    param.grad is released (None) and the held grad is the interpreter's until `DropGrads(bucket)`.
    DeepSpeed: none; stage 3 always copies into its contiguous IPG buffer
    (`__add_grad_to_ipg_bucket`).
    """

    bucket: BucketId
    dtype: str
    param: ParamId
    offset: int
    numel: int


@record
class ReduceBucket(NamedTuple):
    """SUM-reduce the bucket's grads across ranks on `path`, in `dtype`; each rank keeps its
    partitions.

    allreduce: all-reduce the flat bucket, then each slot's [r*s, (r+1)*s) clipped to numel and
    zero-padded to s. reduce_scatter: one reduce-scatter of the padded grads, interleaved per
    rank in ParamId order. Both give the same partitions (I3). `contiguous`: the grads were
    taken out of param.grad when placed, into the flat bucket (CopyToBucket) or held as they are
    (HoldGrad); False: read from each param's own grad, cast to `dtype` (contiguous_gradients
    off, or one grad bigger than the whole bucket). Each grad is divided by `predivide` first
    (1.0: nothing to do); AverageGrads' divisor accounts for it (see [Note: pre-division] in
    fz3/core/grad/grads.py). Runs on the reduce stream with overlap_comm.
    DeepSpeed: `__reduce_and_partition_ipg_grads` -> `__avg_scatter_grads` /
    `__avg_scatter_contiguous_grads`.
    """

    bucket: BucketId
    dtype: str  # the comm dtype (fz3.core.grad.grads.bucket_dtype)
    path: ReducePath
    slots: tuple[Slot, ...]  # in bucket (offset) order
    contiguous: bool
    predivide: float = 1.0  # each grad / this before the SUM (fz3.core.grad.grads.grad_predivide)
    across: int = 1  # hybrid sharding: then each partition all-reduced over this many groups, the
    # ranks holding the same shard (1: no second axis; [Note: hybrid sharding], fz3/core/stage.py)


@record
class WritePartition(NamedTuple):
    """Write this rank's reduced slice of `param` (from `bucket`) into its grad partition.

    copy on the first write in the accumulation window, add on later ones.
    DeepSpeed: `partition_grads` (copy_ when micro_step_id == 0, else add_).
    """

    bucket: BucketId
    param: ParamId
    mode: WriteMode


@record
class DropGrads(NamedTuple):
    """The bucket's full grads are consumed: its buffer is free again.

    `contiguous`: the grads lived in the flat bucket or were held (param.grad was released when
    they were placed); False: they are the params' own grads, so set each param.grad to None.
    """

    bucket: BucketId
    params: tuple[ParamId, ...]
    contiguous: bool


@record
class WaitReduce(NamedTuple):
    """The compute stream waits for the reduce stream: every reduce and write so far is done.

    DeepSpeed: the reduce-stream synchronize in `independent_gradient_partition_epilogue`.
    """


@record
class ZeroPartitions(NamedTuple):
    """Fill these params' grad partitions with zeros: they got no grad in this window."""

    params: tuple[ParamId, ...]


@record
class FreePartitions(NamedTuple):
    """The optimizer consumed the window's averaged grads: the grad partitions' memory goes back
    until the window after it writes them again (its first write of each is a copy, and
    ZeroPartitions covers the rest, so no value is read before it is written). Between
    optimizer steps and through every forward, a rank then holds no gradient memory.
    FSDP2: `zero_grad(set_to_none=True)` frees its sharded grads; DeepSpeed keeps its flat
    partition buffer for the whole run.
    """


@record
class AverageGrads(NamedTuple):
    """Divide every grad partition by `divisor` (= world size x gradient_accumulation_steps /
    the reduces' predivide: fz3.core.grad.epilogue.grad_divisor).

    Partitions then hold the mean gradient; the optimizer reads them in place (views, no copy).
    One division of the exact sum, never the backend's AVG (gloo's is wrong, HCCL emulates it).
    DeepSpeed: `averaged_gradients` in `independent_gradient_partition_epilogue`.
    """

    divisor: float  # an int (W x gas) unless the grads were pre-divided


@record
class ClearGrads(NamedTuple):
    """param.grad = None for these params: the grads that waited there for the boundary's
    reduce are dropped (zero_grad at stages 0 and 1: [Note: grads at the boundary],
    fz3/core/grad/grads.py)."""

    params: tuple[ParamId, ...]


GradEffect = Union[CopyToBucket, HoldGrad, ReduceBucket, WritePartition, DropGrads, WaitReduce,
                   ZeroPartitions, AverageGrads, FreePartitions, ClearGrads]
