"""Invariants of the gradient lifecycle, written once.

Used by the unit tests, the Hypothesis machine (fz3/testing/grad_machine.py) and the shell's
debug mode (`fz3.Options.debug_checks`). Each raises InvariantError naming what broke. They walk the
whole bucket or log, so they are for checking, never for the hot path.

    check_grad_state   buckets: one per dtype, slots packed from 0 without overlap, fill adds
                       up and fits the capacity (reduce_bucket_size, or the hold budget
                       when smaller and grads are held), each slot's param points back at it;
                       0 <= micro_step < gradient_accumulation_steps; nothing
                       reported after the boundary's average
    check_reduce_log   one backward's effects: every reported grad reduced exactly once, each
                       reduce followed by one write per slot and one DropGrads; a contiguous
                       bucket's copies (or holds, never both) match its slots, and grads are
                       held (HoldGrad) only for a reduce on the reduce_scatter path
    check_drained      after an epilogue: no open bucket, and (with overlap_comm) a WaitReduce
                       after the last reduce
"""
from __future__ import annotations

from collections import Counter
from typing import Optional, Sequence, Union

from fz3.config.config import Config
from fz3.core.effects import (CopyToBucket, DropGrads, HoldGrad, ReduceBucket, WaitReduce,
                              WritePartition)
from fz3.core.grad.grads import GradState, capacity
from fz3.core.ids import ParamId
from fz3.core.param.invariants import InvariantError


Placed = Union[CopyToBucket, HoldGrad]  # how a grad placed in a contiguous bucket got there


def _fail(msg: str) -> None:
    raise InvariantError(msg)


def check_grad_state(state: GradState, *, config: Config) -> None:
    """Structural invariants of the IPG buckets and counters."""
    dtypes = [b.dtype for b in state.buckets]
    if dtypes != sorted(set(dtypes)):
        _fail(f"open buckets must be one per dtype, sorted by dtype; got {dtypes}")
    for b in state.buckets:
        slots = b.slots
        if not slots:
            _fail(f"bucket {b.id} ({b.dtype}) is open but empty")
        offset = 0
        for s in slots:
            if s.offset != offset:
                _fail(f"bucket {b.id}: slot of param {s.param} starts at {s.offset}, expected "
                      f"{offset} (slots overlap or leave a hole)")
            if s.numel != state.spec.params[s.param].numel:
                _fail(f"bucket {b.id}: slot of param {s.param} has numel {s.numel}, the param "
                      f"has {state.spec.params[s.param].numel}")
            if state.params[s.param].bucket != b.id:
                _fail(f"param {s.param} sits in bucket {b.id} but records bucket "
                      f"{state.params[s.param].bucket}")
            offset += s.numel
        if offset != b.fill:
            _fail(f"bucket {b.id}: fill {b.fill} != sum of slot numels {offset}")
        most = capacity(config, in_place_reduce_scatter=state.in_place_reduce_scatter,
                        hold_budget=state.hold_budget)
        if b.fill > most:
            _fail(f"bucket {b.id}: fill {b.fill} > its capacity {most} (reduce_bucket_size "
                  f"{config.reduce_bucket_size}, hold budget {state.hold_budget})")
        dup = [p for p, n in Counter(s.param for s in slots).items() if n > 1]
        if dup:
            _fail(f"bucket {b.id} holds params {dup} more than once")
    if not 0 <= state.micro_step < config.gradient_accumulation_steps:
        _fail(f"micro_step {state.micro_step} outside [0, {config.gradient_accumulation_steps})")
    if state.averaged and (state.buckets or state.micro_backwards):
        _fail(f"the window is averaged with {len(state.buckets)} open bucket(s) and {state.micro_backwards} "
              "backward(s) after the average")


def check_reduce_log(effects: Sequence[object], reported: Sequence[ParamId], *,
                     config: Config) -> None:
    """Over one whole backward (bucket_adds .. epilogue): each report reduced exactly once.

    Without contiguous_gradients a re-report (new graph task) of a param whose slot is still
    open merges into param.grad, so a param is then reduced at least once and at most once per
    report; the values (I3) show nothing was counted twice.
    """
    reduced: Counter[ParamId] = Counter()
    copies: dict[int, list[Placed]] = {}  # copied or held, not yet reduced
    pending: dict[int, tuple[ReduceBucket, list[ParamId]]] = {}  # reduced, not yet dropped
    seen: set[int] = set()  # buckets reduced
    for e in effects:
        if isinstance(e, (CopyToBucket, HoldGrad)):
            copies.setdefault(e.bucket, []).append(e)
        elif isinstance(e, ReduceBucket):
            _check_reduce(e, copies, seen)
            seen.add(e.bucket)
            pending[e.bucket] = (e, [])
            reduced.update(s.param for s in e.slots)
        elif isinstance(e, WritePartition):
            if e.bucket not in pending:
                _fail(f"WritePartition of param {e.param} from bucket {e.bucket}, which is not "
                      "being reduced")
            pending[e.bucket][1].append(e.param)
        elif isinstance(e, DropGrads):
            _check_drop(e, pending.pop(e.bucket, None))
    if pending:
        _fail(f"buckets {sorted(pending)} reduced but their grads never dropped")
    if copies:
        _fail(f"grads copied into (or held for) buckets {sorted(copies)} that were never reduced")
    want = Counter(reported)
    if config.contiguous_gradients:
        ok = reduced == want
    else:
        ok = set(reduced) == set(want) and all(reduced[p] <= want[p] for p in reduced)
    if not ok:
        _fail(f"reduced {dict(reduced)} != reported {dict(want)}")


def _check_reduce(e: ReduceBucket, copies: dict[int, list[Placed]], seen: set[int]) -> None:
    if e.bucket in seen:
        _fail(f"bucket {e.bucket} reduced twice")
    if not e.contiguous:
        return
    placed = copies.pop(e.bucket, [])
    got = [(c.param, c.offset, c.numel) for c in placed]
    if got != [tuple(s) for s in e.slots]:
        _fail(f"bucket {e.bucket}: copies {got} do not match its slots {e.slots}")
    kinds = sorted({type(c).__name__ for c in placed})
    if len(kinds) > 1:
        _fail(f"bucket {e.bucket} mixes {kinds}: a reduce reads either a flat bucket or held grads")
    if kinds == ["HoldGrad"] and e.path != "reduce_scatter":
        _fail(f"bucket {e.bucket}: grads held (HoldGrad) for a reduce on path {e.path!r}; only a "
              "reduce-scatter reads grads in place, an all-reduce reduces the flat bucket")


def _check_drop(e: DropGrads, reduce: Optional[tuple[ReduceBucket, list[ParamId]]]) -> None:
    if reduce is None:
        _fail(f"DropGrads of bucket {e.bucket}, which was not reduced")
        return
    red, written = reduce
    want = tuple(s.param for s in red.slots)
    if tuple(written) != want or e.params != want or e.contiguous != red.contiguous:
        _fail(f"bucket {e.bucket}: slots {want}, written {written}, dropped {e}")


def check_drained(state: GradState, effects: Sequence[object], *, config: Config) -> None:
    """After an epilogue: every bucket flushed and, with overlap_comm, the reduce stream waited."""
    if state.buckets:
        _fail(f"open buckets after the epilogue: {[b.id for b in state.buckets]}")
    if not config.overlap_comm:
        return
    last_reduce = max((i for i, e in enumerate(effects) if isinstance(e, ReduceBucket)), default=-1)
    waits = [i for i, e in enumerate(effects) if isinstance(e, WaitReduce)]
    if not waits or waits[-1] < last_reduce:
        _fail("epilogue with overlap_comm did not wait for the reduce stream after the last reduce")
