"""The gradient lifecycle, part 1: the IPG bucket. `bucket_add` places a grad, `flush` reduces.

    grad of p ready (its AccumulateGrad hook fired)
        |  bucket_add(p, dtype)
        v
    open IPG bucket of the comm dtype (communication_data_type, else the grad's `dtype`):
    slots (param, offset, numel), fill <= capacity: reduce_bucket_size (held grads: at most
    the carrier's hold budget)
        |  the grad gets there by (grad_route, [Note: copy or hold]):
        |    CopyToBucket   copied into the flat bucket buffer   contiguous_gradients
        |    HoldGrad       kept as it is, read in place         ... with reduce_scatter and a
        |                                                        carrier that reads grads in place
        |    (nothing)      stays in param.grad                  contiguous_gradients off
        |  (next grad would overflow: flush first;  grad > whole bucket: reduced on its own)
        |  flush / epilogue
        v
    ReduceBucket(path, predivide) --> WritePartition(p, copy | add) per slot --> DropGrads
                               copy: first write of p in this accumulation window; add: later

Per-param flags cost O(1) to reset: a param records the backward (and graph task) of its last
report, so "reported in this backward" is `reported == state.backward`, and advancing the
backward counter (the epilogue, fz3/core/grad/epilogue.py) clears every flag at once.

The Notes this file cites are at its end.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

from fz3.config.config import COMM_DTYPES, Config
from fz3.core.effects import (ADD, COPY, CopyToBucket, DropGrads, GradEffect, HoldGrad, ReduceBucket,
                              Slot, WriteMode, WritePartition)
from fz3.core.ids import BucketId, ParamId
from fz3.core.pvec import PVec
from fz3.core.spec import ModelSpec
from fz3.core.stage import policy

NEVER = -1


class GradError(ValueError):
    """A grad event the lifecycle cannot accept (a double report, a full accumulation window)."""


class ParamGrad(NamedTuple):
    """Per-param gradient bookkeeping (one PVec entry). NEVER (-1) = not yet."""

    reported: int  # backward counter at its last bucket_add
    task: int  # graph task of that report
    bucket: int  # BucketId it was last placed in
    written: int  # accumulation window of its last partition write
    got: int = NEVER  # accumulation window of its last real grad (a leaf's zeros stand in for
    # none: [Note: no grad, no step])
    waits: int = NEVER  # window whose grads wait whole in param.grad for the boundary's reduce
    # ([Note: grads at the boundary]); `wait_dtype` is theirs
    wait_dtype: str = ""


UNSEEN = ParamGrad(NEVER, NEVER, NEVER, NEVER, NEVER)


class Link(NamedTuple):
    """Slots of a bucket as a persistent stack (newest first): adding a slot is O(1)."""

    slot: Slot
    prev: Optional["Link"]


class IPGBucket(NamedTuple):
    """An open (non-empty) IPG bucket of one comm dtype. DeepSpeed: `IPGBucketZ3`."""

    id: BucketId
    dtype: str
    last: Link  # newest slot; `slots` lists them oldest first
    fill: int  # elements used; the next slot starts here

    @property
    def slots(self) -> tuple[Slot, ...]:
        out: list[Slot] = []
        link: Optional[Link] = self.last
        while link is not None:
            out.append(link.slot)
            link = link.prev
        return tuple(reversed(out))


class GradState(NamedTuple):
    """Gradient lifecycle state. Build with `init_grad_state(spec)`; never edit, replace."""

    spec: ModelSpec  # static; shared by every state
    params: PVec[ParamGrad]  # indexed by ParamId
    buckets: tuple[IPGBucket, ...]  # open buckets, at most one per dtype, sorted by dtype
    next_bucket: int  # BucketId of the next bucket opened
    backward: int  # epilogues run so far: the id of the current backward
    micro_step: int  # step() calls in the cycle of gradient_accumulation_steps: DeepSpeed's micro_steps
    # mod gas, which decides the boundary ([Note: the window closes at step()], epilogue.py)
    window: int  # accumulation windows finished (optimizer steps taken)
    # static: the reduce-scatter carrier sends each grad from where it lies, so a bucket would
    # only stage a copy ([Note: copy or hold])
    in_place_reduce_scatter: bool = False
    skipped: int = 0  # windows closed without an optimizer step: a non-finite grad norm
    applied: bool = False  # the last window closed with an optimizer step (DeepSpeed's
    # was_step_applied; False before the first)
    # static: held buckets are reduced at this many elements at most (0: no budget beyond
    # reduce_bucket_size; [Note: hold budget])
    hold_budget: int = 0
    micro_backwards: int = 0  # backwards ended since the last step() (or the window's start)
    committed: bool = False  # a step() off the boundary took grads into the window: zero_grad()
    # cannot drop the newer ones alone ([Note: zero_grad in a window], epilogue.py)
    averaged: bool = False  # the boundary's step() divided the partitions into the mean: the
    # optimizer step (or its skip) is due


def init_grad_state(spec: ModelSpec, *, in_place_reduce_scatter: bool = False,
                    hold_budget: int = 0) -> GradState:
    """The state before the first backward: no buckets, no grads, micro_step 0.

    `in_place_reduce_scatter`: the interpreter's reduce-scatter carrier reads each grad in place
    (its `in_place_reduce_scatter`); grads are then held rather than copied (`grad_route`).
    `hold_budget`: elements of held grads the carrier gains from batching (its `hold_budget`;
    0: none beyond reduce_bucket_size), [Note: hold budget].
    """
    if isinstance(hold_budget, bool) or not isinstance(hold_budget, int) or hold_budget < 0:
        raise ValueError(f"init_grad_state: hold_budget must be an int >= 0 (0: no budget), got {hold_budget!r}")
    return GradState(spec, PVec([UNSEEN] * len(spec.params)), (), 0, 0, 0, 0,
                     in_place_reduce_scatter, hold_budget=hold_budget)


def resumed(state: GradState, *, window: int, backward: int, skipped: int = 0, micro_step: int = 0
            ) -> GradState:
    """The state after a checkpoint load: a fresh one at the checkpoint's counters (`window`
    also counts the skipped windows; `micro_step`: the engine's own position in its cycle of
    step() calls, which DeepSpeed's load_checkpoint leaves as it was). Per-param records left by training before the load could
    equal the restored counters and turn a window's first write into an add, so none is kept;
    the static carrier flag stays."""
    return init_grad_state(state.spec, in_place_reduce_scatter=state.in_place_reduce_scatter,
                           hold_budget=state.hold_budget)._replace(
        window=window, backward=backward, skipped=skipped, micro_step=micro_step)


def new_pass(state: GradState) -> GradState:
    """A forward pass starts: forget what no later transition can read, so that the state a
    steady-state pass starts from is the same every step but for the backward and window
    counters ([Note: a pass forgets], fz3/core/replay.py).

    Every read of a param's record compares a field with the current counter: `reported` (and
    with it `task` and `bucket`) with `backward`, `written`, `got` and `waits` with `window`; counters
    only grow. So a field that differs from its counter now differs from it for good, and
    NEVER says the same: such fields become NEVER. Bucket ids restart at 0 when no bucket is
    open and no record is of this backward (no id can still be met). O(params), once a pass."""
    b, w = state.backward, state.window
    changes: dict[int, ParamGrad] = {}
    current = False
    for p, pg in enumerate(state.params.current()):
        if pg.reported == b:
            current = True
            continue
        if pg.written == w or pg.got == w or pg.waits == w:
            new = ParamGrad(NEVER, NEVER, NEVER, w if pg.written == w else NEVER, w if pg.got == w else NEVER,
                            w if pg.waits == w else NEVER, pg.wait_dtype if pg.waits == w else "")
        else:
            new = UNSEEN
        if new != pg:
            changes[p] = new
    params = state.params.set_many(changes)
    if current or state.buckets:
        return state._replace(params=params)
    return state._replace(params=params, next_bucket=0)


def bucket_add(state: GradState, param: ParamId, *, config: Config, dtype: str = "float32",
               graph_task: int = 0, stand_in: bool = False) -> tuple[GradState, tuple[GradEffect, ...]]:
    """Place `param`'s ready grad (a `dtype` tensor) in the IPG bucket of its comm dtype
    (`bucket_dtype`: communication_data_type, else `dtype`); the bucket holds it cast to that.
    `stand_in`: the grad is zeros standing in for none (a leaf's expert that saw no token on
    this rank), reduced so that every rank reduces the same; the param did not get a grad
    ([Note: no grad, no step]).

    Flushes that bucket first if the grad would overflow it; a grad larger than the whole bucket
    is reduced on its own, straight from param.grad. The bucket's size is `capacity`. Raises
    GradError, naming the param, if it was already reported in this backward and graph task, or
    if the window was averaged and not yet stepped.
    DeepSpeed: `reduce_ready_partitions_and_remove_grads` -> `__add_grad_to_ipg_bucket`.
    """
    _check_report(state, param, graph_task, config)
    pg = state.params[param]
    got = pg.got if stand_in else state.window
    if policy(config).grads_at_boundary:  # it waits in param.grad: [Note: grads at the boundary]
        return state._replace(params=state.params.set(param, pg._replace(
            reported=state.backward, task=graph_task, got=got, waits=state.window, wait_dtype=dtype))), ()
    comm = bucket_dtype(dtype, config=config)
    effects: list[GradEffect] = []
    stale = _open(state, pg.bucket) if pg.reported == state.backward else None
    if stale is not None and not config.contiguous_gradients:
        # the new partial grad accumulated into param.grad, which the open slot reads at reduce
        return state._replace(params=state.params.set(param, pg._replace(task=graph_task))), ()
    if stale is not None:  # its first grad waits in the bucket; reduce that before this one
        state, eff = flush(state, config=config, dtype=stale.dtype)
        effects += eff
    state = state._replace(params=state.params.set(param, state.params[param]._replace(
        reported=state.backward, task=graph_task, got=got)))
    state, eff = _admit(state, param, comm, config)
    return state, tuple(effects) + eff


def flush_waiting(state: GradState, *, config: Config) -> tuple[GradState, tuple[GradEffect, ...]]:
    """The boundary's reduce of every grad that waited whole in param.grad through the window
    ([Note: grads at the boundary]): each into its bucket, in param order (every rank the same),
    then every bucket flushed. O(params), once a window. DeepSpeed: stage 1's reduce_gradients
    in the boundary's backward, the engine's allreduce_gradients at stage 0."""
    w = state.window
    effects: list[GradEffect] = []
    for p, pg in enumerate(state.params.current()):
        if pg.waits == w:
            state, eff = _admit(state, ParamId(p), bucket_dtype(pg.wait_dtype, config=config), config)
            effects += eff
    state, eff = flush(state, config=config)
    return state, tuple(effects) + eff


def waiting(state: GradState) -> tuple[ParamId, ...]:
    """The params whose grads wait in param.grad for the boundary ([Note: grads at the boundary])."""
    w = state.window
    return tuple(ParamId(p) for p, pg in enumerate(state.params) if pg.waits == w)


def flush(state: GradState, *, config: Config, dtype: Optional[str] = None
          ) -> tuple[GradState, tuple[GradEffect, ...]]:
    """Reduce the open IPG bucket of `dtype` (every open bucket, in dtype order, if None).

    Emits ReduceBucket on `config.reduce_path`, one WritePartition per slot, then DropGrads.
    A flush with nothing open emits nothing.
    DeepSpeed: `__reduce_and_partition_ipg_grads` (+ `partition_grads`).
    """
    effects: list[GradEffect] = []
    for bucket in state.buckets:
        if dtype is None or bucket.dtype == dtype:
            state, eff = _reduce(state, bucket.id, bucket.dtype, bucket.slots,
                                 config.contiguous_gradients, config)
            effects += eff
    return state, tuple(effects)


def bucket_dtype(grad_dtype: str, *, config: Config) -> str:
    """The dtype a grad of `grad_dtype` is reduced in: communication_data_type if set, else its own.

    One IPG bucket per such dtype. DeepSpeed: `engine.communication_data_type` (unset: the model
    dtype, which is the grads' dtype here) and the per-dtype `ipg_buckets` of stage 3.
    """
    if config.communication_data_type is None:
        return grad_dtype
    return COMM_DTYPES[config.communication_data_type]


def grad_route(state: GradState, config: Config) -> Optional[type[CopyToBucket] | type[HoldGrad]]:
    """How a grad placed in an open bucket reaches its reduce: the effect that takes it out of
    param.grad, or None when it stays there.

        contiguous_gradients off                          None: the reduce reads param.grad
        reduce_scatter on, in_place_reduce_scatter        HoldGrad: kept as it is, read in place
        otherwise                                         CopyToBucket: into the flat bucket

    Why hold: a reduce-scatter carrier that sends each grad from where it lies (p2p) would only
    send what the copy staged; holding saves the copy and the bucket's memory ([Note: copy or
    hold]). The all-reduce path reduces the flat bucket itself, so it always copies. A grad
    bigger than the bucket is never placed: it is reduced alone from param.grad.
    DeepSpeed: `__add_grad_to_ipg_bucket`, which always copies (with contiguous_gradients).
    """
    if not config.contiguous_gradients:
        return None
    if state.in_place_reduce_scatter and config.reduce_path == "reduce_scatter":
        return HoldGrad
    return CopyToBucket


def capacity(config: Config, *, in_place_reduce_scatter: bool, hold_budget: int) -> int:
    """Elements an IPG bucket takes before it is reduced: reduce_bucket_size, or the carrier's
    hold budget when that is smaller and grads are held ([Note: hold budget]). The interpreter
    sizes its reduce buffers by it."""
    held = config.contiguous_gradients and config.reduce_path == "reduce_scatter" and in_place_reduce_scatter
    if held and hold_budget:
        return min(config.reduce_bucket_size, hold_budget)
    return config.reduce_bucket_size


def reduce_across(spec: ModelSpec) -> int:
    """The groups a bucket's partitions are all-reduced across once reduced within the group
    ([Note: hybrid sharding], fz3/core/stage.py): the replicas of a layout of several ranks. A
    layout of one rank (stage 0) reduces over every rank at once: nothing after (1)."""
    return spec.groups


def grad_predivide(world_size: int, config: Config) -> float:
    """What every grad is divided by before the reduce (see [Note: pre-division]): the world size
    with prescale_gradients, else gradient_predivide_factor; 1.0 = nothing. Grads reduced in
    fp16 (the compute or the communication dtype) are divided by the world size unless a factor
    is given: a sum of W of them would overflow where DeepSpeed's, divided first, does not.
    DeepSpeed: `postscale_gradients` / `gradient_predivide_factor` in stage 3's
    `__avg_scatter_grads`, which ignores the factor under prescale_gradients, as here; stage 3
    divides by W before every reduce (`reduce_scatter_coalesced`).
    """
    if config.prescale_gradients:
        return float(world_size)
    if config.gradient_predivide_factor == 1 and (config.communication_data_type or config.compute_dtype) == "fp16":
        return float(world_size)
    return float(config.gradient_predivide_factor)


def fits(fill: int, numel: int, capacity: int) -> bool:
    """A grad of `numel` still fits in a bucket holding `fill` of `capacity` elements."""
    return fill + numel <= capacity


def write_mode(pg: ParamGrad, window: int) -> WriteMode:
    """copy on the param's first partition write in `window`, add on later ones."""
    return ADD if pg.written == window else COPY


def _reduce(state: GradState, bucket: BucketId, dtype: str, slots: tuple[Slot, ...],
            contiguous: bool, config: Config) -> tuple[GradState, tuple[GradEffect, ...]]:
    effects: list[GradEffect] = [ReduceBucket(bucket, dtype, config.reduce_path, slots, contiguous,
                                              grad_predivide(state.spec.ranks, config),
                                              across=reduce_across(state.spec))]
    params = state.params
    for slot in slots:
        pg = params[slot.param]
        effects.append(WritePartition(bucket, slot.param, write_mode(pg, state.window)))
        params = params.set(slot.param, pg._replace(written=state.window))
    effects.append(DropGrads(bucket, tuple(s.param for s in slots), contiguous))
    buckets = tuple(b for b in state.buckets if b.id != bucket)
    return state._replace(params=params, buckets=buckets), tuple(effects)


def _admit(state: GradState, param: ParamId, comm: str, config: Config
           ) -> tuple[GradState, tuple[GradEffect, ...]]:
    """`param`'s grad (a `comm` dtype reduce) into its bucket: the bucket flushed first if the grad
    would overflow it, or the grad reduced on its own if it is bigger than a whole bucket."""
    numel = state.spec.params[param].numel
    most = capacity(config, in_place_reduce_scatter=state.in_place_reduce_scatter, hold_budget=state.hold_budget)
    effects: tuple[GradEffect, ...] = ()
    bucket = _bucket_of(state, comm)
    if bucket is not None and not fits(bucket.fill, numel, most):
        state, effects = flush(state, config=config, dtype=comm)
    if numel > most:
        state, eff = _reduce_alone(state, param, comm, config)
    else:
        state, eff = _place(state, param, comm, config)
    return state, effects + eff


def _place(state: GradState, param: ParamId, dtype: str, config: Config
           ) -> tuple[GradState, tuple[GradEffect, ...]]:
    """Append a slot for `param` to the open bucket of `dtype` (opening one if none is open)."""
    numel = state.spec.params[param].numel
    bucket = _bucket_of(state, dtype)
    if bucket is None:
        slot = Slot(param, 0, numel)
        bucket = IPGBucket(BucketId(state.next_bucket), dtype, Link(slot, None), numel)
        state = state._replace(next_bucket=state.next_bucket + 1)
    else:
        slot = Slot(param, bucket.fill, numel)
        bucket = bucket._replace(last=Link(slot, bucket.last), fill=bucket.fill + numel)
    others = [b for b in state.buckets if b.dtype != dtype]
    pg = state.params[param]._replace(bucket=bucket.id)
    state = state._replace(buckets=tuple(sorted(others + [bucket], key=lambda b: b.dtype)),
                           params=state.params.set(param, pg))
    route = grad_route(state, config)
    if route is None:
        return state, ()
    return state, (route(bucket.id, dtype, param, slot.offset, numel),)


def _reduce_alone(state: GradState, param: ParamId, dtype: str, config: Config
                  ) -> tuple[GradState, tuple[GradEffect, ...]]:
    """A grad bigger than the bucket: reduce it from param.grad itself, in a bucket of its own."""
    bucket = BucketId(state.next_bucket)
    pg = state.params[param]._replace(bucket=bucket)
    state = state._replace(next_bucket=state.next_bucket + 1, params=state.params.set(param, pg))
    slot = Slot(param, 0, state.spec.params[param].numel)
    return _reduce(state, bucket, dtype, (slot,), False, config)


def _check_report(state: GradState, param: ParamId, graph_task: int, config: Config) -> None:
    if not 0 <= param < len(state.spec.params):
        raise GradError(f"bucket_add: no param with id {param} "
                        f"(ids run 0..{len(state.spec.params) - 1})")
    if state.averaged:
        raise GradError(f"bucket_add({_name(state, param)}): the boundary's step() averaged the grad "
                        "partitions; call optimizer_step first")
    pg = state.params[param]
    if pg.reported == state.backward and pg.task == graph_task:
        raise GradError(f"param {_name(state, param)} reported twice in one backward (graph task "
                        f"{graph_task}); a new graph task (reentrant checkpointing) must say so")


def _name(state: GradState, param: ParamId) -> str:
    return f"{state.spec.params[param].name!r} (id {param})"


def _bucket_of(state: GradState, dtype: str) -> Optional[IPGBucket]:
    for b in state.buckets:
        if b.dtype == dtype:
            return b
    return None


def _open(state: GradState, bucket: int) -> Optional[IPGBucket]:
    for b in state.buckets:
        if b.id == bucket:
            return b
    return None


# ---- Notes --------------------------------------------------------------------------------------
#
# [Note: copy vs add] DeepSpeed copies on micro_step 0 and adds later, so a param that gets no
# grad in micro-step 0 but does later adds onto the previous window's stale partition. fz3 copies
# on the param's *first write in the window* (it records the window of its last write), and the
# epilogue zeroes the partitions never written in a window.
#
# [Note: pre-division] Partitions hold sums over ranks and micro-steps; the boundary divides once,
# by W x gas / predivide, where each grad was divided by `grad_predivide` before the reduce: 1
# (nothing) by default, W with prescale_gradients or when grads are reduced in fp16,
# gradient_predivide_factor otherwise. Either way
# the partitions end as the mean gradient. Pre-dividing keeps the sum of W grads inside the range
# of a narrow comm dtype (fp16). DeepSpeed stage 3 divides every grad by W before each reduce
# (`reduce_scatter_coalesced`, `__avg_scatter_contiguous_grads`), with a predivide factor f also by
# f before and times f after, and scales the loss by 1/gas; it refuses prescale_gradients and f != 1
# with reduce_scatter on (an assert in `DeepSpeedZeroOptimizer_Stage3.__init__`), while fz3 runs
# them on both reduce paths: the same arithmetic, in another order.
#
# [Note: copy or hold] DeepSpeed copies every grad into the contiguous IPG buffer, which one
# collective then reads. A point-to-point reduce-scatter (gloo's p2p carrier) sends each rank's
# slice straight from each grad, and the native one (NCCL, HCCL) packs the grads into its
# rank-major input in one op (torch._chunk_cat, FSDP2's copy-in), so a bucket copy would only
# stage them a second time: with such a carrier
# (`init_grad_state(..., in_place_reduce_scatter=True)`) and reduce_scatter on, a placed grad is
# held instead (HoldGrad), saving the copy and the bucket's memory. The interpreter says what its
# carrier does; the choice is made here, where the machines see it (fz3/testing/grad_machine.py).
#
# [Note: hold budget] A held grad is the grad autograd made, kept whole until its bucket is
# reduced, so an open bucket of held grads holds reduce_bucket_size elements of grads beside the
# model (DeepSpeed's default 5e8: 2 GB per rank in fp32, whatever the model) while the carrier
# gains nothing from that batching: it sends grad by grad, and packs only the small ones
# (fz3/interpreters/messages.py). The interpreter says how many elements its carrier gains from batching
# (`hold_budget`, init_grad_state), and held buckets are reduced at the smaller of that and
# reduce_bucket_size (`capacity`). A copied bucket keeps reduce_bucket_size: the one buffer it
# copies into is the memory DeepSpeed's users sized, and a collective over it is what batching
# buys.
#
# [Note: grads at the boundary] At stages 0 and 1 (fz3/core/stage.py) a grad is not reduced when
# autograd has accumulated it: bucket_add marks the param `waits` (this window) and returns no
# effect, so the grad stays whole in param.grad, where the window's later backwards add to it
# (AccumulateGrad), as DeepSpeed's stage 0 and 1 accumulate before their one reduce. The step()
# that closes the window reduces every waiting grad (`flush_waiting`), the partitions' one write
# of the window (copy), and the average follows as at any stage. A zero_grad drops them
# (ClearGrads). The reduce's traffic is once a window instead of once a backward; the grads are
# whole in the meantime, the memory stage 1 spends where stage 2 does not.
#
# [Note: reentrant checkpointing] A param used inside and outside a reentrant-checkpointed region
# fires its grad hook once per graph task. The shell passes the graph task; a second report in a
# new task is a partial grad, reduced and added. If the first is still in an open bucket: with
# contiguous_gradients the first grad sits in the bucket (copied or held) and param.grad was
# released, so the bucket is flushed first and the new grad takes a fresh slot (no bucket ever
# holds a param twice; DeepSpeed PR #7780 fixed stale buckets here); without, autograd accumulated
# the new grad into param.grad, which the open slot reads at reduce time, so there is nothing to do.
