"""The verdict on the device (fz3/testing/verdict_machine.py) under the active profile, and its
teeth: each planted bug in fz3/core/grad/verdict.py is caught by the machine (fixed settings,
derandomized)."""
import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from fz3.core.grad import verdict
from fz3.testing.verdict_machine import VerdictMachine

TestVerdict = VerdictMachine.TestCase

STRICT = settings(max_examples=300, deadline=None, database=None, derandomize=True,
                  phases=[Phase.explicit, Phase.generate], report_multiple_bugs=False)
_read, _taken = verdict.read, verdict.taken


def never_put_back(v, finite, *, every_rank):
    """Planted: a skip read late leaves the lr scheduler stepped."""
    v, effects = _read(v, finite, every_rank=every_rank)
    return v, tuple(e for e in effects if not isinstance(e, verdict.PutBackScheduler))


def owed_dropped_by_a_user_read(v, finite, *, every_rank):
    """Planted: a user's read of a skip forgets the WARNING owed for it."""
    v, effects = _read(v, finite, every_rank=every_rank)
    return (v._replace(owed=0) if not every_rank else v), effects


def counted_twice(v, finite, *, every_rank):
    """Planted: the skip is counted again when its WARNING is given."""
    new, effects = _read(v, finite, every_rank=every_rank)
    if any(isinstance(e, verdict.NameSkipped) for e in effects) and not v.pending:
        new = new._replace(skipped=new.skipped + 1)
    return new, effects


def steps_with_pending(v, *, step, finite, scheduler):
    """Planted: a step is taken over an unread verdict (it is dropped)."""
    return _taken(verdict.Verdict(skipped=v.skipped, applied=v.applied), step=step, finite=finite,
                  scheduler=scheduler)


def skip_steps_the_scheduler(v, *, step, finite, scheduler):
    """Planted: a skip read at once still steps the lr scheduler."""
    v, effects = _taken(v, step=step, finite=True if finite is False else finite, scheduler=scheduler)
    return v, effects


BUGS = {
    "lr scheduler never put back": (verdict, "read", never_put_back),
    "owed WARNING dropped by a user's read": (verdict, "read", owed_dropped_by_a_user_read),
    "a skip counted twice": (verdict, "read", counted_twice),
    "a step over an unread verdict": (verdict, "taken", steps_with_pending),
    "a skip read at once steps the scheduler": (verdict, "taken", skip_steps_the_scheduler),
}


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_machine_catches(bug, monkeypatch):
    module, attr, fn = BUGS[bug]
    monkeypatch.setattr(module, attr, fn)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(VerdictMachine, settings=STRICT)
