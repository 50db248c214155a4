"""`python -m fz3 verify`: the property-based proof run from the command line.

Runs the Hypothesis machines against their naive models at a chosen depth and prints, per
invariant of the design (DESIGN.md §3, docs/architecture.md), how often it was checked and in
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

I7 (equivalence to unsharded training) needs real ranks and torch autograd: the parity tests
(tests/test_parity.py) prove it, not these machines, and the report says so.

A failing property prints Hypothesis' shrunk counterexample (the machine's step log) and the
run exits 1.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import fz3.testing.extra  # noqa: F401 - Hypothesis, or an ImportError naming the test extra
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test

from fz3.testing import coverage
from fz3.testing import layout_check as lc

MACHINES = ("params", "grads", "layout", "calls", "scaler")

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
}
NOT_HERE = {"I7": "equivalence to unsharded training: real ranks, proven by tests/test_parity.py"}


@dataclass
class Report:
    examples: int
    steps: int
    seconds: dict[str, float] = field(default_factory=dict)
    counts: "coverage.Counter[tuple[str, str]]" = field(default_factory=coverage.Counter)
    failure: tuple[str, BaseException] | None = None

    def table(self, situations: int = 4) -> str:
        """Per invariant: checks, distinct situations, and the most frequent ones."""
        lines = [f"fz3 verify: {self.examples} examples per machine, up to {self.steps} rules each",
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
            lines += ["", f"FAILED in {self.failure[0]}: {type(self.failure[1]).__name__}: {self.failure[1]}"]
        return "\n".join(lines)


NAMES = {"params": "parameter lifecycle", "grads": "gradient lifecycle", "layout": "layout",
         "calls": "module calls", "scaler": "loss scale"}


def verify(examples: int = 100, steps: int = 20, machines: tuple[str, ...] = MACHINES) -> Report:
    """Run `machines` with `examples` Hypothesis examples each (state machines: up to `steps`
    rules per example). Stops at the first failing machine (Report.failure)."""
    if examples < 1:
        raise ValueError(f"examples must be >= 1, got {examples}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    unknown = [m for m in machines if m not in MACHINES]
    if unknown or not machines:
        raise ValueError(f"machines {list(machines)!r}: choose from {list(MACHINES)}")
    report = Report(examples, steps)
    coverage.take()
    chosen = settings(max_examples=examples, stateful_step_count=steps, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
    for m in machines:
        start = time.perf_counter()
        try:
            _run(m, chosen)
        except BaseException as e:  # noqa: BLE001 - a falsified property: report it
            if isinstance(e, KeyboardInterrupt):
                raise
            report.failure = (m, e)
        report.seconds[m] = time.perf_counter() - start
        if report.failure is not None:
            break
    report.counts = coverage.take()
    return report


def _run(machine: str, chosen: settings) -> None:
    if machine == "params":
        from fz3.testing.param_machine import ParamLifecycleMachine
        run_state_machine_as_test(ParamLifecycleMachine, settings=chosen)
    elif machine == "grads":
        from fz3.testing.grad_machine import GradMachine
        run_state_machine_as_test(GradMachine, settings=chosen)
    elif machine == "calls":
        from fz3.testing.calls_machine import CallsMachine
        run_state_machine_as_test(CallsMachine, settings=chosen)
    elif machine == "scaler":
        from fz3.testing.scaler_machine import ScalerMachine
        run_state_machine_as_test(ScalerMachine, settings=chosen)
    else:
        many = st.lists(lc.numels, max_size=6)
        for check, args in ((lc.round_trip, (lc.numels, lc.worlds, lc.seeds, lc.shapes)),
                            (lc.gather_round_trip, (many, lc.worlds, lc.seeds)),
                            (lc.reduce_slices, (many, lc.worlds, lc.seeds))):
            chosen(given(*args)(_counted(check)))()


def _counted(check):
    @functools.wraps(check)  # @given reads the check's signature
    def run(*args, **kwargs):
        coverage.covered("examples", "layout")
        check(*args, **kwargs)
    return run
