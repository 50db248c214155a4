"""The three streams (fz3/testing/stream_machine.py) under the active profile, and its teeth:
each planted reordering in fz3/core/streams.py is caught by the machine (fixed settings,
derandomized)."""
import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from fz3.core import streams
from fz3.testing.patch import patched
from fz3.testing.stream_machine import StreamMachine

TestStreams = StreamMachine.TestCase

STRICT = settings(max_examples=200, deadline=None, database=None, derandomize=True,
                  phases=[Phase.explicit, Phase.generate], report_multiple_bugs=False)
_gather, _gathered, _complete, _reduce = streams.gather, streams.gathered, streams.complete, streams.reduce


def gathered_unwaited(st, h):
    """Planted: compute reads a gathered param without waiting its gather's event."""
    st, _ = _gathered(st, h)
    return st, ()


def gather_before_compute(st, h, ps):
    """Planted: the gather stream does not wait for compute (the optimizer's shard writes)."""
    st, ops = _gather(st, h, ps)
    return st, tuple(op for op in ops if type(op) is not streams.WaitEvent)


def completed_unwaited(st, b=None):
    """Planted: a reduce is Completed (its output read, its grads let go) without compute
    waiting its event."""
    st, ops = _complete(st, b)
    return st, tuple(op for op in ops if type(op) is not streams.WaitEvent)


def never_pending(st, b):
    """Planted: a bucket's writes and drops run at once, its reduce still in flight."""
    return False


def reduce_before_backward(st, b, reads, *, max_reduces=streams.MAX_REDUCES_IN_FLIGHT):
    """Planted: the reduce stream does not wait for the grads backward wrote."""
    st, ops = _reduce(st, b, reads, max_reduces=max_reduces)
    i = max(i for i, op in enumerate(ops) if type(op) is streams.Launch)
    return st, tuple(op for j, op in enumerate(ops) if not (j == i - 1 and type(op) is streams.WaitEvent))


BUGS = {
    "a gathered param read before its wait": ("fz3.core.streams:gathered", gathered_unwaited),
    "a gather before the shards' writes": ("fz3.core.streams:gather", gather_before_compute),
    "a reduce completed unwaited": ("fz3.core.streams:complete", completed_unwaited),
    "writes and drops not deferred": ("fz3.core.streams:pending", never_pending),
    "a reduce before the grads": ("fz3.core.streams:reduce", reduce_before_backward),
}


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_machine_catches(bug):
    target, fn = BUGS[bug]
    with patched(target, fn):
        with pytest.raises(AssertionError):
            run_state_machine_as_test(StreamMachine, settings=STRICT)
