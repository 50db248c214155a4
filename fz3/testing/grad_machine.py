"""A Hypothesis state machine for the gradient lifecycle, checked against a naive model.

    initialize: world size 1-4, params of numel 0-40 (float32 / float64 grads), a bucket of
                1-64 elements (often the fill of a run of grads, +-1), a reduce path, 1-4
                accumulation steps, overlap_comm on or off, a comm dtype (or none),
                prescale_gradients on or off, a gradient_predivide_factor, a reduce-scatter
                that reads grads in place or not (init_grad_state's in_place_reduce_scatter)
    rules:      report, report_all, report_backward (grad ready -> bucket_add)
                report_twice (must raise, naming the param)
                new_graph_task (reentrant checkpointing)   flush   end_backward (epilogue)
                step (micro_step_end: DeepSpeed's count, or an override)   zero_grad
                training_step (a whole backward, its end, step(): a loop's micro-step)
                optimizer_step   step_too_early / grads_after_the_average (must raise)
    stages:     3 and 2 reduce each backward; 1 keeps the grads whole in param.grad and reduces
                them all at the boundary's step() (fz3/core/stage.py; stage 0 is stage 1's grads
                over a layout of one rank, the engine's tests)
    invariant:  check_grad_state after every rule

Any number of backwards may come between two step() calls, and any number of step() calls
between two boundaries ([Note: the window closes at step()]). At every boundary each rank's
partitions must equal the naive mean slices bit for bit (I3): the sum of every grad reported in
the window, over W x gas. Every grad reported in a backward must have been reduced exactly
once, and no bucket may be open. zero_grad drops the grads of the backwards since the last
step() exactly when the window holds nothing older, and is refused exactly when it does. Every report must take its grad out of param.grad as the naive model's table says
(CopyToBucket, HoldGrad or neither), and a grad is held only with a reduce-scatter that reads
grads in place, for a bucket then reduced on the reduce_scatter path. Reuse it:
`TestGrads = GradMachine.TestCase`, or subclass and override rules.
"""
from __future__ import annotations

from collections import Counter

import torch
import fz3.testing.extra  # noqa: F401 - Hypothesis, or an ImportError naming the test extra
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from fz3.core.grad import epilogue as ep
from fz3.core.grad import grads
from fz3.config.config import Config
from fz3.core.effects import HoldGrad, ReduceBucket
from fz3.core.grad.grads import GradError
from fz3.core.ids import ParamId
from fz3.core.grad.invariants import check_drained, check_grad_state, check_reduce_log
from fz3.interpreters.simulated import SimulatedWorld
from fz3.testing.coverage import covered
from fz3.testing.grad_naive import (COMMS, DTYPES, PATHS, PREDIVIDES, NaiveGrads, bucket_sizes,
                                    check_bucket_sizes, check_placement, expected_placement, grad_multiple, grad_spec,
                                    small_int_grads)


class GradMachine(RuleBasedStateMachine):
    """bucket_add / flush / epilogue / optimizer_step on a simulated world vs NaiveGrads."""

    @initialize(params=st.lists(st.tuples(st.integers(0, 40), st.sampled_from(sorted(DTYPES))),
                                min_size=1, max_size=6),
                world_size=st.integers(1, 4), path=st.sampled_from(sorted(PATHS)),
                gas=st.integers(1, 4), overlap=st.booleans(), seed=st.integers(0, 2**32 - 1),
                managed=st.sampled_from([True, True, True, False]), stage=st.sampled_from([3, 3, 2, 1]),
                comm=st.sampled_from(COMMS), prescale=st.booleans(),
                predivide=st.sampled_from(PREDIVIDES), in_place=st.booleans(),
                groups=st.sampled_from([1, 1, 2, 3]), data=st.data())
    def setup(self, params: list[tuple[int, str]], world_size: int, path: str, gas: int,
              overlap: bool, seed: int, managed: bool, stage: int, comm: str | None, prescale: bool, predivide: float,
              in_place: bool, groups: int, data: st.DataObject) -> None:
        # hybrid sharding: `groups` groups of `world_size` ranks (a layout of several ranks only)
        self.groups = groups if world_size > 1 else 1
        self.ranks = world_size * self.groups
        bucket = data.draw(bucket_sizes([n for n, _ in params]), label="reduce_bucket_size")
        self.hold = data.draw(st.one_of(st.just(0), bucket_sizes([n for n, _ in params])), label="hold_budget")
        self.config = Config(reduce_bucket_size=bucket, gradient_accumulation_steps=gas,
                             managed_gradient_accumulation=managed, stage=stage,
                             overlap_comm=overlap, communication_data_type=comm,
                             prescale_gradients=prescale, gradient_predivide_factor=predivide,
                             **PATHS[path])
        self.multiple = grad_multiple(self.config, self.ranks)
        self.dtypes = [d for _, d in params]
        tdtypes = [DTYPES[d] for d in self.dtypes]
        spec = grad_spec([n for n, _ in params], world_size, self.groups)
        self.path, self.in_place = path, in_place
        self.state = grads.init_grad_state(spec, in_place_reduce_scatter=in_place, hold_budget=self.hold)
        self.world = SimulatedWorld(spec, config=self.config, grad_dtypes=tdtypes)
        self.naive = NaiveGrads([n for n, _ in params], tdtypes, self.ranks, shard_world=world_size)
        self.axes_seen = self._axes()
        self.gen = torch.Generator().manual_seed(seed)
        self.task, self.seen, self.reported, self.log_start = 0, set(), [], 0
        self.older = False  # a step() off the boundary took grads into the window
        self.at_boundary = stage < 2  # grads wait in param.grad for the boundary's step()
        self.waiting: set[int] = set()  # ... and which do
        note(f"W={self.ranks} ({self.groups} group(s) of {world_size}) params={params} path={path} "
             f"in_place_reduce_scatter={in_place} hold_budget={self.hold} {self.config}")
        self.situation = (f"{path}, W={world_size}" + (f" x {self.groups} groups" if self.groups > 1 else "")
                          + f", {gas} micro-step{'s' if gas > 1 else ''}")
        covered("examples", "gradient lifecycle")

    def _axes(self) -> tuple[dict, dict]:
        return dict(self.world.reduced_on["within"]), dict(self.world.reduced_on["across"])

    def _check_axes(self, log: list) -> None:
        """[Note: hybrid sharding] Each slot of each ReduceBucket in `log` (the reduces since the
        last check, which check_reduce_log holds to the grads reported) was reduced once within
        its group and, with several groups, once across them; nothing else was."""
        before, now = self.axes_seen, self._axes()
        self.axes_seen = now
        slots = Counter(s.param for e in log if isinstance(e, ReduceBucket) for s in e.slots)
        for axis, old, new in (("within", before[0], now[0]), ("across", before[1], now[1])):
            want = dict(slots) if axis == "within" or self.groups > 1 else {}
            got = {p: new.get(p, 0) - old.get(p, 0) for p in set(new) | set(old)}
            got = {p: n for p, n in got.items() if n}
            assert got == want, (f"reduces {axis} the groups since the last check: {got}, not once per slot "
                                 f"{want} ({self.groups} group(s))")
        if self.groups > 1:
            covered("reduced once", f"within and across {self.groups} groups")

    def _run(self, effects: tuple) -> None:
        note(f"  -> {list(effects)}")
        check_bucket_sizes(effects, self.path, self.in_place, self.config.reduce_bucket_size, self.hold)
        self.world.run(effects)

    def _window_open(self) -> bool:
        return not self.state.averaged

    @precondition(lambda self: self._window_open())
    @rule(data=st.data())
    def report(self, data: st.DataObject) -> None:
        self._report(ParamId(data.draw(st.integers(0, len(self.dtypes) - 1), label="param")))

    @precondition(lambda self: self._window_open())
    @rule(data=st.data())
    def report_all(self, data: st.DataObject) -> None:
        """A whole backward's worth of grads, in an arbitrary order."""
        for p in data.draw(st.permutations(range(len(self.dtypes))), label="order"):
            self._report(ParamId(p))

    @precondition(lambda self: self._window_open())
    @rule()
    def report_backward(self) -> None:
        """A whole backward in the order autograd reports grads: last param first."""
        for p in reversed(range(len(self.dtypes))):
            self._report(ParamId(p))

    def _report(self, p: ParamId) -> None:
        if p in self.seen:
            return  # reporting it again in this graph task is report_twice's business
        g = small_int_grads(self.gen, self.state.spec.params[p].numel, len(self.world.shards),
                            DTYPES[self.dtypes[p]], self.multiple)
        note(f"report p{p} (task {self.task}) grads {[t.tolist() for t in g]}")
        self.naive.add(p, g)
        self.world.accumulate_grad(p, g)
        self.state, eff = grads.bucket_add(self.state, p, config=self.config,
                                           dtype=self.dtypes[p], graph_task=self.task)
        # at the boundary: nothing placed until the step() ([Note: grads at the boundary])
        want = None if self.at_boundary else expected_placement(
            self.path, self.in_place, self.state.spec.params[p].numel, self.config.reduce_bucket_size, self.hold)
        check_placement(eff, p, want)
        covered("naive model", f"grad placed by {want or 'neither copy nor hold'} ({self.path})")
        self._run(eff)
        self.seen.add(p)
        self.reported.append(p)

    @precondition(lambda self: bool(self.seen))
    @rule(data=st.data())
    def report_twice(self, data: st.DataObject) -> None:
        p = data.draw(st.sampled_from(sorted(self.seen)), label="param")
        note(f"report p{p} again in task {self.task}: must raise")
        try:
            grads.bucket_add(self.state, p, config=self.config, dtype=self.dtypes[p],
                             graph_task=self.task)
        except GradError as err:
            assert f"'p{p}'" in str(err), f"the error does not name p{p}: {err}"
            covered("misuse refused", "a grad reported twice in one graph task")
        else:
            raise AssertionError(f"p{p} reported twice in one graph task was accepted")

    @rule()
    def new_graph_task(self) -> None:
        self.task += 1
        self.seen = set()
        note(f"new graph task {self.task} (reentrant checkpoint)")

    @rule(which=st.sampled_from([None, *sorted(DTYPES), "bfloat16", "float16"]))
    def flush(self, which: str | None) -> None:
        note(f"flush({which})")
        self.state, eff = grads.flush(self.state, config=self.config, dtype=which)
        self._run(eff)

    @precondition(lambda self: self._window_open())
    @rule()
    def end_backward(self) -> None:
        note(f"epilogue at micro_step {self.state.micro_step}")
        self.state, eff = ep.epilogue(self.state, config=self.config)
        self._run(eff)
        check_drained(self.state, eff, config=self.config)
        if self.at_boundary:
            assert not any(isinstance(e, ReduceBucket) for e in self.world.log[self.log_start:]), (
                "a grad reduced before the boundary's step()")
            self.waiting |= set(self.reported)
        else:
            check_reduce_log(self.world.log[self.log_start:], self.reported, config=self.config)
            self._check_holds(self.world.log[self.log_start:])
            self._check_axes(self.world.log[self.log_start:])
            covered("reduced once", self.situation)
        self.task, self.seen, self.reported, self.log_start = 0, set(), [], len(self.world.log)

    @precondition(lambda self: self._window_open() and not self.state.buckets and not self.reported)
    @rule(override=st.sampled_from([None, None, None, True, False]))
    def step(self, override: bool | None) -> None:
        """The user's step(): the window closes where DeepSpeed's count (or the override) says."""
        want = (not self.config.managed_gradient_accumulation or override
                or (override is None and (self.state.micro_step + 1) % self.config.gradient_accumulation_steps == 0))
        note(f"step() at micro_step {self.state.micro_step}, override {override}: boundary {want}")
        backwards = self.state.micro_backwards
        self.state, eff = ep.micro_step_end(self.state, config=self.config, override=override)
        self._run(eff)
        assert ep.at_boundary(self.state, config=self.config) == want, "the window closed at another step()"
        if self.at_boundary and want:  # the window's one reduce: every waiting grad once
            check_reduce_log(list(eff), sorted(self.waiting), config=self.config)
            self._check_holds(list(eff))
            self._check_axes(list(eff))
            covered("reduced once", self.situation + ", at the boundary")
            self.waiting = set()
        elif self.at_boundary:
            assert not any(isinstance(e, ReduceBucket) for e in eff), "a grad reduced off the boundary"
        self.log_start = len(self.world.log)
        if want:
            self.naive.check(self.world, self.ranks * self.config.gradient_accumulation_steps)
            covered("I3", self.situation)
        elif backwards:
            self.older = True

    @precondition(lambda self: self._window_open() and not self.state.buckets and not self.reported)
    @rule()
    def training_step(self) -> None:
        """A training loop's micro-step, whole: a backward in autograd's order, its end, step()."""
        self.report_backward()
        self.end_backward()
        self.step(None)

    @precondition(lambda self: self._window_open() and not self.reported)
    @rule()
    def zero_grad(self) -> None:
        """Drops the backwards since the last step() when nothing older is in the window."""
        pending, older = self.state.micro_backwards, self.older
        note(f"zero_grad() with {pending} backward(s) since the last step(), older grads {older}")
        try:
            self.state, eff = ep.zero_grads(self.state, config=self.config)
        except GradError as err:
            assert pending and older, f"zero_grad() refused with nothing to refuse: {err}"
            covered("misuse refused", "zero_grad() after a step() inside the window")
            return
        assert not (pending and older), "zero_grad() accepted where older grads share the partitions"
        self._run(eff)
        if pending:
            self.naive.reset()
            self.waiting = set()
            covered("naive model", "zero_grad() dropped a micro-step's grads")

    @precondition(lambda self: not self._window_open())
    @rule()
    def optimizer_step(self) -> None:
        note("optimizer_step")
        self.state, eff = ep.optimizer_step(self.state, config=self.config)
        self._run(eff)
        self.naive.reset()
        self.older = False

    @precondition(lambda self: not self._window_open())
    @rule()
    def grads_after_the_average(self) -> None:
        note("epilogue / bucket_add / step() after the average: must raise")
        for call in (lambda: ep.epilogue(self.state, config=self.config),
                     lambda: ep.micro_step_end(self.state, config=self.config),
                     lambda: grads.bucket_add(self.state, ParamId(0), config=self.config,
                                              dtype=self.dtypes[0], graph_task=self.task + 1)):
            try:
                call()
            except GradError:
                covered("misuse refused", "grads after the boundary's average")
                continue
            raise AssertionError("an averaged window accepted more grads")

    @precondition(lambda self: self._window_open())
    @rule()
    def step_too_early(self) -> None:
        note("optimizer_step before the boundary: must raise")
        try:
            ep.optimizer_step(self.state, config=self.config)
        except GradError:
            covered("misuse refused", "an optimizer step inside the window")
            return
        raise AssertionError("optimizer_step accepted before the accumulation boundary")

    def _check_holds(self, log: list) -> None:
        """Grads are held only when the reduce-scatter reads them in place; check_reduce_log has
        checked that each held bucket was reduced on the reduce_scatter path, the only path whose
        carrier can read a grad where it lies."""
        held = [e for e in log if isinstance(e, HoldGrad)]
        if held and not self.in_place:
            raise AssertionError(f"placement: {held[0]} without an in-place reduce-scatter")

    @invariant()
    def state_is_sound(self) -> None:
        if hasattr(self, "state"):
            check_grad_state(self.state, config=self.config)
            assert self.state.in_place_reduce_scatter == self.in_place, "a static field changed"
            assert self.state.hold_budget == self.hold, "a static field changed"
