"""I5 in numbers: whatever the trace, prefetch, reuse and persistence decide, every compute reads
the current values of its params.

The same drawn passes (fz3/testing/models.py: nested calls, repeats, conditional variants,
externals, partial and raising passes) run through the core under three configs: the drawn one,
a starved one (no prefetch, no live budget, no reuse, no persistence) and a generous one
(prefetch and reuse everything, every param persistent), each on a simulated world of W ranks
holding real shards. Between passes an optimizer step may change every shard (and end_of_step
runs). At every compute, on every rank, the full value of each param of the unit must equal
the unsharded value of its current shards (the oracle), bit for bit, in all three runs: a value
gathered before the step and kept (stale), a prefetch waited on by nobody, or a param freed
under a running module all show.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

from fz3.config.config import Config
from fz3.core.param.state import initial_state, unit_of
from fz3.data import layout
from fz3.interpreters.simulated import SimulatedWorld
from fz3.testing.models import HUGE, Case, cases, count_calls, forward_events
from fz3.testing.param_events import Compute, EndOfStep, Reset
from fz3.testing.param_machine import apply_event, pass_events

KINDS = ("complete", "complete", "partial", "none", "abandon", "raise", "step")


def starved(config: Config) -> Config:
    return config.replace(prefetch_bucket_size=0, max_live_parameters=0, max_reuse_distance=0,
                          param_persistence_threshold=0)


def generous(config: Config) -> Config:
    return config.replace(prefetch_bucket_size=HUGE, max_live_parameters=HUGE, max_reuse_distance=HUGE,
                          param_persistence_threshold=HUGE)


@st.composite
def schedules(draw, case: Case) -> list[tuple]:
    """(program, kind, detail) per pass; "step": an optimizer step after a finished backward."""
    out, finished = [], False
    for _ in range(draw(st.integers(2, 7))):
        kind = draw(st.sampled_from(KINDS))
        if kind == "step":
            if finished:
                out.append((0, "step", None))
            finished = False
            continue
        which = draw(st.integers(0, len(case.programs) - 1))
        detail = None
        if kind == "partial":
            detail = draw(st.frozensets(st.integers(0, count_calls(case.programs[which]) - 1)))
        elif kind == "raise":
            n = len(forward_events(case.programs[which]))
            detail = draw(st.integers(1, n - 1))
        out.append((which, kind, detail))
        finished = kind in ("complete", "partial")
    return out


def run(case: Case, config: Config, schedule: list[tuple]) -> list[list[torch.Tensor]]:
    """The schedule through the core under `config` on a simulated world; -> at every compute,
    the full values its unit read on every rank (checked against the oracle as they come)."""
    spec = case.model.spec(config)
    W = spec.world_size
    gen = torch.Generator().manual_seed(0)
    fulls = [torch.randint(-9, 10, (p.numel,), generator=gen).float() for p in spec.params]
    world = SimulatedWorld.from_params(spec, fulls, config=config)
    st_, seen, raised = initial_state(spec), [], False
    for which, kind, detail in schedule:
        if kind == "step":  # the optimizer changes every shard, then end_of_step
            world.shards = [[s + 1 for s in shards] for shards in world.shards]
            st_, effects = apply_event(st_, EndOfStep(), config)
            world.run(effects)
            continue
        events = pass_events(case.programs[which], kind, detail)
        events[0] = Reset(kind != "none", raised)
        raised = kind == "raise"
        for ev in events:
            st_, effects = apply_event(st_, ev, config)
            world.run(effects)
            if type(ev) is Compute:
                seen.append(read_unit(world, st_, ev.module, W))
    return seen


def read_unit(world: SimulatedWorld, st_, module: int, W: int) -> list[torch.Tensor]:
    out = []
    for p in unit_of(st_, module):
        want = layout.unshard([world.shards[r][p] for r in range(W)], (world.spec.params[p].numel,))
        for r in range(W):
            got = world.full[r].get(p)
            assert got is not None, f"I5: m{module} computes on rank {r} without p{p} gathered"
            assert torch.equal(got, want), (
                f"I5: m{module} reads p{p} on rank {r} as {got.tolist()}, its shards say {want.tolist()}")
            out.append(got)
    return out


@given(st.data())
def test_every_compute_reads_current_values_under_any_config(data):
    case = data.draw(cases(), label="case")
    schedule = data.draw(schedules(case), label="schedule")
    runs = {name: run(case, make(case.config), schedule)
            for name, make in (("drawn", lambda c: c), ("starved", starved), ("generous", generous))}
    note(f"computes: {len(runs['drawn'])}")
    for name, seen in runs.items():
        assert len(seen) == len(runs["drawn"]), f"{name}: {len(seen)} computes, drawn {len(runs['drawn'])}"
        for i, (a, b) in enumerate(zip(seen, runs["drawn"])):
            assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b)), (
                f"compute {i}: {name} read other values than the drawn config")


def test_a_stale_persistent_value_is_caught(monkeypatch):
    """Planted: end_of_step frees nothing (persistent params stay gathered with the old values)."""
    import fz3.core.param.step as step
    from hypothesis import HealthCheck, Phase, settings

    monkeypatch.setattr(step, "end_of_step", lambda st_, *, config: (st_, ()))

    @settings(max_examples=100, derandomize=True, database=None, deadline=None,
              phases=(Phase.generate,), suppress_health_check=list(HealthCheck))
    @given(st.data())
    def hunt(data):
        case = data.draw(cases())
        schedule = data.draw(schedules(case))
        run(case, generous(case.config), schedule)

    with pytest.raises(AssertionError, match="I5: .* its shards say"):
        hunt()
