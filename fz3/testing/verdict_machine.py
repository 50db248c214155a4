"""The verdict on the device as a Hypothesis state machine ([Note: the verdict on the device],
fz3/core/grad/verdict.py), against a run that reads every verdict at its boundary.

    initialize   whether the engine has an lr scheduler
    rules        boundary(finite, on_device): the engine's order: the pending flag read (every
                 rank), then the step taken, its verdict on the device or read at once;
                 user_read: was_step_applied() or the skipped count, this rank alone (the flag
                 read if one is pending); early_step: a step taken with a verdict unread (refused)
    checks       every applied step runs at the naive run's lr (the scheduler's position); the
                 counts read are the naive run's; each skipped step's WARNING is given once, at
                 the latest at the next boundary; nothing stays pending past a boundary

The scheduler is its position (what it has been stepped to); StepScheduler keeps it when
undoable, PutBackScheduler goes back to what was kept, as fz3/shell/verdict.py does to a real one.
Reuse: `TestVerdict = VerdictMachine.TestCase`.
"""
from __future__ import annotations

import fz3.testing.extra  # noqa: F401 - Hypothesis, or an ImportError naming the test extra
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from fz3.core.grad import verdict
from fz3.testing.coverage import covered


class VerdictMachine(RuleBasedStateMachine):
    @initialize(scheduler=st.booleans())
    def setup(self, scheduler: bool) -> None:
        self.scheduler = scheduler
        self.v = verdict.Verdict()
        self.flag: bool | None = None  # the pending step's truth, on the "device"
        self.position, self.kept = 0, None  # the scheduler
        self.steps = self.host_skipped = 0  # steps taken; those skipped with the verdict read at once
        self.applied = False  # what was_step_applied says once read
        self.lrs: list[tuple[int, int]] = []  # (step, scheduler position) of each applied step
        self.warned: list[int] = []
        # the naive run: every verdict read at its boundary
        self.naive_position, self.naive_lrs, self.naive_warned = 0, [], []
        self.naive_skipped, self.naive_applied = 0, False
        note(f"scheduler: {scheduler}")
        covered("examples", "step verdict")

    def _run(self, effects) -> None:
        for e in effects:
            match e:
                case verdict.StepScheduler(undoable):
                    assert self.scheduler, "the scheduler stepped where the engine has none"
                    self.kept = self.position if undoable else None
                    self.position += 1
                case verdict.PutBackScheduler():
                    assert self.kept is not None, "the scheduler put back without what it was"
                    self.position, self.kept = self.kept, None
                    covered("late verdict", "lr scheduler put back after a skip read late")
                case verdict.NameSkipped(step):
                    self.warned.append(step)
                    covered("late verdict", "a skip's WARNING given a step late")

    def _read(self, *, every_rank: bool) -> None:
        finite = None if not self.v.pending else self.flag
        self.v, effects = verdict.read(self.v, finite, every_rank=every_rank)
        if finite is not None:
            self.applied = finite
        self._run(effects)

    @precondition(lambda self: hasattr(self, "v"))
    @rule(finite=st.sampled_from([True, True, True, False]), on_device=st.booleans())
    def boundary(self, finite: bool, on_device: bool) -> None:
        self.steps += 1
        note(f"step {self.steps}: {'finite' if finite else 'NOT finite'}, verdict {'on the device' if on_device else 'read at once'}")
        self._read(every_rank=True)
        assert not self.v.pending, "a verdict left pending past the next boundary"
        assert self.warned == self.naive_warned, (
            f"at step {self.steps}'s boundary the WARNINGs given are {self.warned}, the naive run's {self.naive_warned}")
        if finite:
            self.lrs.append((self.steps, self.position))
        self.v, effects = verdict.taken(self.v, step=self.steps, finite=None if on_device else finite,
                                        scheduler=self.scheduler)
        self._run(effects)
        if on_device:
            self.flag = finite
            covered("late verdict", "step taken, verdict on the device" + ("" if finite else " (skipped)"))
        else:
            self.applied = finite
            self.host_skipped += not finite
            if not finite:
                self.warned.append(self.steps)  # the engine names it at once (SkipStep)
        # the naive run
        if finite:
            self.naive_lrs.append((self.steps, self.naive_position))
            self.naive_position += self.scheduler
        else:
            self.naive_skipped += 1
            self.naive_warned.append(self.steps)
        self.naive_applied = finite

    @precondition(lambda self: hasattr(self, "v"))
    @rule()
    def user_read(self) -> None:
        note("user reads was_step_applied() / the skipped count")
        if self.v.pending:
            covered("late verdict", "read by the user before the next boundary")
        self._read(every_rank=False)
        assert self.host_skipped + self.v.skipped == self.naive_skipped, (
            f"skipped steps read: {self.host_skipped + self.v.skipped}, the naive run's {self.naive_skipped}")
        assert self.applied == self.naive_applied, (self.applied, self.naive_applied)
        if self.scheduler:
            assert self.position == self.naive_position, (
                f"the lr scheduler read at position {self.position}, the naive run's {self.naive_position}")

    @precondition(lambda self: hasattr(self, "v") and self.v.pending)
    @rule()
    def early_step(self) -> None:
        try:
            verdict.taken(self.v, step=self.steps + 1, finite=True, scheduler=self.scheduler)
        except verdict.VerdictError:
            covered("misuse refused", "a step taken with the last verdict unread")
            return
        raise AssertionError("a step was taken while the last one's verdict was unread")

    @invariant()
    def same_lrs(self) -> None:
        if hasattr(self, "v"):
            assert self.lrs == self.naive_lrs, (
                f"the applied steps ran at scheduler positions {self.lrs}, the naive run's {self.naive_lrs}")
