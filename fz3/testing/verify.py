"""`python -m fz3 verify`: the property-based proof run from the command line.

Runs the Hypothesis machines against their naive models at a chosen depth and prints, per
invariant of the design (docs/architecture.md, "Invariants"), how often it was checked and in
which situations:

    parameter lifecycle   fz3/testing/param_machine.py   I1 live budget, I2 ref counts, I5 trace
                          safety, I6 determinism, purity, agreement with naive_params.py
    gradient lifecycle    fz3/testing/grad_machine.py    I3 accumulation equivalence (bit for
                          bit against grad_naive.py), every grad reduced exactly once, misuse
                          refused
    layout                fz3/testing/layout_check.py    I4 shard / unshard, gather and reduce
                          buffers
    module calls          fz3/testing/calls_machine.py   the decisions of fz3/core/calls.py (which
                          calls get autograd nodes, releases, leaf reductions, externals, the
                          end of backward) against calls_naive.py, on a simulation of torch
                          autograd (autograd_sim.py): I2, I5 in forward and backward, every
                          grad reported once after its last contribution, purity
    loss scale            fz3/testing/scaler_machine.py  fp16's scale, step by step, against
                          DeepSpeed's DynamicLossScaler transcribed (scaler_machine.NaiveScaler)
    optimizer offload     fz3/testing/offload_machine.py the sub-groups and the read / step / write
                          schedule of fz3/core/offload.py against a model of the tiers
    step verdict          fz3/testing/verdict_machine.py a skip decided on the device and read
                          late (fz3/core/grad/verdict.py) against one read at each boundary
    streams               fz3/testing/stream_machine.py  the compute, gather and reduce streams
                          (fz3/core/streams.py) on vector clocks, under the module-call
                          machine's passes: reads after writes, nothing let go while a stream
                          may touch it, the epilogue after every reduce

I7 (equivalence to unsharded training) needs real ranks and torch autograd: the parity tests
(tests/test_parity.py) prove it, not these machines, and the report says so.

A failing property prints FAILED, then Hypothesis' shrunk counterexample as a pytest function
to paste (fz3/testing/regression.py: it replays the shrunk steps through the machine, failing
while the bug is there), then the table; the run exits 1.

    verify(patches=["fz3.core.param.release:release_into=mypkg.bugs:my_release_into"])
        the machines on your replacement of a transition, bound wherever fz3 binds the original
        (fz3/testing/patch.py, [Note: every binding]); all put back after the run
    verify(profile="hunt")
        under a profile of fz3/testing/profiles.py: "hunt" finds and shrinks a bug within a
        minute ([Note: the hunt]); examples and steps, when given, override the profile's

docs/verify.md is the guide.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import time
from dataclasses import dataclass, field
from typing import Sequence

import fz3.testing.extra  # noqa: F401 - Hypothesis, or an ImportError naming the test extra
import hypothesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test

from fz3.testing import coverage
from fz3.testing import layout_check as lc
from fz3.testing.patch import patched, patched_all
from fz3.testing.profiles import PROFILES, SHRINK_SECONDS, shrink_budget
from fz3.testing.regression import regression_test

__all__ = ["verify", "patched", "Report", "MACHINES"]

MACHINES = ("params", "grads", "layout", "calls", "scaler", "offload", "verdict", "streams")

INVARIANTS = {
    "I1": "live budget: prefetch never takes live full params past max_live_parameters",
    "I2": "ref counts balance: after each backward every counter is 0, nothing gathered leaks",
    "I3": "accumulation equivalence: partitions equal the naive mean gradient, bit for bit",
    "I4": "layout: shard / unshard and the collective buffers round-trip any numel, any W",
    "I5": "trace safety: every computing module finds its whole unit gathered, in any trace mode",
    "I6": "determinism: a second rank fed the same events emits the same effects",
    "purity": "transitions never change the state they are given; an old state replays the same",
    "naive model": "the core agrees field by field with a naive model that executed its effects",
    "reduced once": "every grad reported in a backward is reduced exactly once",
    "misuse refused": "misuse raises an error naming what is wrong",
    "call decisions": "autograd nodes, releases, leaf reductions, externals as fz3/core/calls.py decides",
    "reported once": "every grad autograd produces is reported once, after its last contribution",
    "loss scale": "fp16's scale grows, halves and spends its hysteresis where DeepSpeed's does",
    "offload": "offloaded sub-groups: one tier at a time, stepped once after their read, within the budget, "
               "the values of a step without offload",
    "late verdict": "a skip decided on the device and read late: the same lr for every applied step, the same "
               "counts, each skip's WARNING once",
    "stream order": "compute, gather and reduce streams: reads after writes, nothing let go while a stream may touch "
               "it, the epilogue after every reduce",
}
NOT_HERE = {"I7": "equivalence to unsharded training: real ranks, proven by tests/test_parity.py"}


@dataclass
class Report:
    examples: int
    steps: int
    seconds: dict[str, float] = field(default_factory=dict)
    counts: "coverage.Counter[tuple[str, str]]" = field(default_factory=coverage.Counter)
    failure: tuple[str, BaseException] | None = None
    regression: str | None = None  # the shrunk failure as a pytest function (regression.py)
    shrink_stopped: str | None = None  # shrinking stopped at the profile's budget: said so
    profile: str | None = None
    patches: list[str] = field(default_factory=list)  # where each patch was bound

    def failed(self) -> str:
        """FAILED, the error, and the shrunk case as a regression test to paste; "" if none."""
        if self.failure is None:
            return ""
        machine, error = self.failure
        others = ""
        if isinstance(error, BaseExceptionGroup):  # report_multiple_bugs: the first here, all on stderr
            n = len(error.exceptions) - 1
            others, error = f" (and {n} other distinct failure{'s' * (n > 1)}: see stderr)", error.exceptions[0]
        lines = [f"FAILED in {machine}: {type(error).__name__}: {error}{others}", ""]
        lines += [f"({self.shrink_stopped})", ""] if self.shrink_stopped else []
        if self.regression is None:
            lines += ["(no shrunk case to print: Hypothesis' account is on stderr)", ""]
        else:
            lines += ["the shrunk case, as a regression test to paste (it fails while the bug is there, "
                      "passes once it is gone):", "", self.regression]
        return "\n".join(lines)

    def text(self) -> str:
        """What `python -m fz3 verify` prints: `head`, then `table`."""
        return "\n".join(x for x in (self.head(), self.table()) if x)

    def head(self) -> str:
        """Where each patch was bound, then `failed`: what comes before the table."""
        return "\n".join(self.patches + ([""] if self.patches and self.failure else []) + [self.failed()]).strip("\n")

    def table(self, situations: int = 4) -> str:
        """Per invariant: checks, distinct situations, and the most frequent ones."""
        profile = f" (profile {self.profile})" if self.profile else ""
        lines = [f"fz3 verify{profile}: {self.examples} examples per machine, up to {self.steps} rules each",
                 "", f"{'machine':<15} {'seconds':>8}  examples"]
        for m, s in self.seconds.items():
            lines.append(f"{m:<15} {s:8.1f}  {self.counts.get(('examples', NAMES[m]), 0):,}")
        lines += ["", f"{'invariant':<15} {'checks':>9} {'situations':>10}  what holds"]
        for inv, what in INVARIANTS.items():
            rows = {k[1]: v for k, v in self.counts.items() if k[0] == inv}
            lines.append(f"{inv:<15} {sum(rows.values()):>9,} {len(rows):>10}  {what}")
            for sit, n in sorted(rows.items(), key=lambda kv: (-kv[1], kv[0]))[:situations]:
                lines.append(f"{'':<15} {n:>9,} {'':>10}    {sit}")
            if len(rows) > situations:
                lines.append(f"{'':<15} {'':>9} {'':>10}    ... {len(rows) - situations} more")
        for inv, what in NOT_HERE.items():
            lines.append(f"{inv:<15} {'-':>9} {'-':>10}  {what}")
        if self.failure is not None:
            lines += ["", f"FAILED in {self.failure[0]} (the shrunk case is at the top)"]
        return "\n".join(lines)


NAMES = {"params": "parameter lifecycle", "grads": "gradient lifecycle", "layout": "layout",
         "calls": "module calls", "scaler": "loss scale", "offload": "optimizer offload",
         "verdict": "step verdict", "streams": "streams"}


MACHINE_CLASSES = {"params": ("fz3.testing.param_machine", "ParamLifecycleMachine"),
                   "grads": ("fz3.testing.grad_machine", "GradMachine"),
                   "calls": ("fz3.testing.calls_machine", "CallsMachine"),
                   "scaler": ("fz3.testing.scaler_machine", "ScalerMachine"),
                   "offload": ("fz3.testing.offload_machine", "OffloadMachine"),
                   "verdict": ("fz3.testing.verdict_machine", "VerdictMachine"),
                   "streams": ("fz3.testing.stream_machine", "StreamMachine")}
LAYOUT_CHECKS = ("round_trip", "gather_round_trip", "reduce_slices")  # of fz3/testing/layout_check.py
DEFAULT = settings(settings.get_profile("default"), max_examples=100, stateful_step_count=20, deadline=None,
                   suppress_health_check=list(HealthCheck))


def verify(examples: int | None = None, steps: int | None = None, machines: tuple[str, ...] = MACHINES, *,
           profile: str | None = None, patches: Sequence[str] = (), seed: int | None = None,
           shrink_seconds: float | None = None) -> Report:
    """Run `machines` with `examples` Hypothesis examples each (state machines: up to `steps`
    rules per example): by default 100 and 20, or the `profile`'s (fz3/testing/profiles.py).
    `patches`: "module:function=replacement" strings, each function of fz3 replaced wherever it
    is bound for the run (fz3/testing/patch.py). `seed`: the same seed draws the same examples.
    `shrink_seconds`: stop shrinking a failure after that long (default: the profile's
    SHRINK_SECONDS, else Hypothesis' five minutes). Stops at the first failing machine
    (Report.failure, and Report.regression: the shrunk case as a pytest function). Never writes
    Hypothesis' example database."""
    if examples is not None and examples < 1:
        raise ValueError(f"examples must be >= 1, got {examples}")
    if steps is not None and steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    unknown = [m for m in machines if m not in MACHINES]
    if unknown or not machines:
        raise ValueError(f"machines {list(machines)!r}: choose from {list(MACHINES)}")
    if profile is not None and profile not in PROFILES:
        raise ValueError(f"profile {profile!r}: choose from {list(PROFILES)}")
    base = DEFAULT if profile is None else PROFILES[profile]
    chosen = settings(base, database=None, **{k: v for k, v in (("max_examples", examples),
                                                                  ("stateful_step_count", steps)) if v is not None})
    report = Report(chosen.max_examples, chosen.stateful_step_count, profile=profile)
    runners = {m: _runner(m) for m in machines}  # imported before patching: their bindings are patched too
    budget = shrink_seconds if shrink_seconds is not None else SHRINK_SECONDS.get(profile or "")
    coverage.take()
    with patched_all(patches) if patches else contextlib.nullcontext([]) as done, shrink_budget(budget) as stopped:
        report.patches = [str(p) for p in done]
        for m in machines:
            start = time.perf_counter()
            try:
                _run(m, runners[m], chosen, seed)
            except BaseException as e:  # noqa: BLE001 - a falsified property: report it
                if isinstance(e, KeyboardInterrupt):
                    raise
                report.failure = (m, e)
                report.regression = regression_test(e, name=f"test_{m}_regression", where=_homes(m))
                report.shrink_stopped = stopped[-1] if stopped else None
            report.seconds[m] = time.perf_counter() - start
            if report.failure is not None:
                break
    report.counts = coverage.take()
    return report


def _runner(machine: str):
    """The machine's class, or for layout its checks."""
    if machine == "layout":
        return tuple(getattr(lc, name) for name in LAYOUT_CHECKS)
    module, name = MACHINE_CLASSES[machine]
    return getattr(importlib.import_module(module), name)


def _homes(machine: str) -> dict[str, str]:
    """Where the names a regression test of `machine` calls live."""
    if machine == "layout":
        return {name: lc.__name__ for name in LAYOUT_CHECKS}
    module, name = MACHINE_CLASSES[machine]
    return {name: module}


def _run(machine: str, runner, chosen: settings, seed: int | None) -> None:
    pinned = (lambda f: f) if seed is None else hypothesis.seed(seed)
    if machine != "layout":
        run_state_machine_as_test(pinned(lambda: runner()), settings=chosen)
        return
    many = st.lists(lc.numels, max_size=6)
    for check, args in zip(runner, ((lc.numels, lc.worlds, lc.seeds, lc.shapes), (many, lc.worlds, lc.seeds),
                                    (many, lc.worlds, lc.seeds))):
        pinned(chosen(given(*args)(_counted(check))))()


def _counted(check):
    @functools.wraps(check)  # @given reads the check's signature
    def run(*args, **kwargs):
        coverage.covered("examples", "layout")
        check(*args, **kwargs)
    return run
