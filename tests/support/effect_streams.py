"""The effect streams of drawn cases, as digests: what two processes must print the same (I6).

    python -m tests.support.effect_streams N [--plant NAME]

Draws N cases deterministically (Hypothesis, derandomized: the same cases in every process),
runs each through the core (the param lifecycle's passes of fz3/testing/param_machine.py, and
the grad lifecycle's reports, flushes and epilogues), and prints one JSON list: per case, a
sha256 of every effect's repr in order. Ranks are separate processes with their own hash seeds
(PYTHONHASHSEED), so a core that iterates a set or dict of strings, or of objects hashed by
address, could emit its collectives in another order on another rank; tests/test_determinism.py
runs this in two processes with different seeds and requires equal output.

`--plant names`: a planted bug for the test's teeth: the gather orders its params by iterating
a set of their names.
"""
from __future__ import annotations

import hashlib
import json
import sys

from hypothesis import HealthCheck, Phase, given, settings

from fz3.core.param import state as core_state
from fz3.core.grad.epilogue import epilogue, micro_step_end, optimizer_step
from fz3.core.grad.grads import bucket_add, init_grad_state
from fz3.testing.models import cases
from fz3.core.param.state import initial_state
from fz3.testing.param_events import EndOfStep
from fz3.testing.param_machine import apply_event, pass_events

SCHEDULE = [(0, "complete"), (0, "complete"), (0, "complete"), (1, "partial"), (0, "step"),
            (0, "none"), (0, "complete")]


def digest(case) -> str:
    h = hashlib.sha256()
    st_ = initial_state(case.model.spec(case.config))
    for which, kind in SCHEDULE:  # the events alone: no check may stop a planted bug's stream
        events = [EndOfStep()] if kind == "step" else \
            pass_events(case.programs[min(which, len(case.programs) - 1)], kind)
        for ev in events:
            st_, effects = apply_event(st_, ev, case.config)
            h.update(repr((ev, effects)).encode())
    config = case.config.replace(reduce_bucket_size=7, gradient_accumulation_steps=2)
    spec = case.model.spec(config)
    gs = init_grad_state(spec)
    for _ in range(2):  # two backwards of one window: every param reports, high ids first
        for p in reversed(range(len(spec.params))):
            gs, effects = bucket_add(gs, p, config=config)
            h.update(repr(effects).encode())
        gs, effects = epilogue(gs, config=config)
        h.update(repr(effects).encode())
        gs, effects = micro_step_end(gs, config=config)
        h.update(repr(effects).encode())
    gs, effects = optimizer_step(gs, config=config)
    h.update(repr(effects).encode())
    return h.hexdigest()


def streams(n: int) -> list[str]:
    out: list[str] = []

    @settings(max_examples=n, derandomize=True, database=None, deadline=None, phases=(Phase.generate,),
              suppress_health_check=list(HealthCheck))
    @given(cases())
    def draw(case):
        out.append(digest(case))

    draw()
    return out


def plant_names() -> None:
    """The gather's params ordered by iterating a set of their names (hash-seed dependent)."""
    real = core_state.gather

    def gather(tx, pids, *, prefetch, forward, fetched_for):
        names = {tx.st.spec.params[p].name: p for p in pids}
        order = [names[n] for n in set(names)]
        steps = dict(zip(pids, fetched_for))
        real(tx, tuple(order), prefetch=prefetch, forward=forward, fetched_for=tuple(steps[p] for p in order))

    for module in ("fz3.core.param.fetch", "fz3.core.param.backward", "fz3.core.param.step", "fz3.core.param.hold"):
        mod = sys.modules.get(module) or __import__(module, fromlist=["gather"])
        if hasattr(mod, "gather"):
            mod.gather = gather


def main(argv: list[str]) -> None:
    n = int(argv[0])
    if argv[1:] == ["--plant", "names"]:
        plant_names()
    print(json.dumps(streams(n)))


if __name__ == "__main__":
    main(sys.argv[1:])
