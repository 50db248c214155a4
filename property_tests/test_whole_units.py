"""What engine.generation keeps whole (fz3/core/param/whole.py, [Note: generation keeps units
whole]), drawn: the models of the parameter machine (nesting, tied params, leaves, empty params,
persistence on and off) and budgets from 0 past the model.

    within    the kept params take at most the budget; they are the kept units' own
    maximal   no unit left out would fit in what the budget has left
    fewest    with no param shared between units, no choice within the budget keeps more units
              (checked against every subset of a model's units)
    None      every unit with something to gather
Teeth: the largest units first (a planted bug) keeps fewer, and is caught.
"""
from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from fz3.config.config import Config
from fz3.core.param import whole
from fz3.testing.models import models


@st.composite
def spec_and_budget(draw):
    model = draw(models())
    spec = model.spec(Config(param_persistence_threshold=draw(st.sampled_from([0, 2]))))
    total = sum(p.numel for p in spec.params if not p.persistent)
    return spec, draw(st.one_of(st.none(), st.integers(0, total + 3)))


def check(spec, budget) -> None:
    got = whole.keep_whole(spec, budget)
    units = dict(whole.units(spec))
    numel = [p.numel for p in spec.params]
    kept = set(got.params)
    assert kept == {p for m in got.modules for p in units[m]}, "the kept params are the kept units' own"
    assert got.numel == sum(numel[p] for p in kept)
    if budget is None:
        assert set(got.modules) == set(units), "None keeps every unit"
        return
    assert got.numel <= budget, f"{got.numel} kept > budget {budget}"
    for m, ps in units.items():
        if m not in got.modules:
            extra = sum(numel[p] for p in ps if p not in kept)
            assert got.numel + extra > budget, f"unit m{m} ({extra} more) fits in what is left: not maximal"
    owners = [p for ps in units.values() for p in ps]
    if len(owners) == len(set(owners)) and len(units) <= 8:  # no param shared: the most units within it
        sizes = [sum(numel[p] for p in ps) for ps in units.values()]
        best = max(k for k in range(len(sizes) + 1)
                   if any(sum(c) <= budget for c in itertools.combinations(sizes, k)))
        assert len(got.modules) == best, f"kept {len(got.modules)} units, {best} fit: not the fewest gathers"


@settings(max_examples=300, deadline=None)
@given(spec_and_budget())
def test_the_kept_units_fit_the_budget_and_are_the_most_that_fit(case):
    check(*case)


def test_the_largest_first_is_caught(monkeypatch):
    real = sorted

    def descending(items, key=None, reverse=False):
        return real(items, key=key, reverse=not reverse)
    monkeypatch.setattr(whole, "sorted", descending, raising=False)
    hunt = settings(max_examples=300, derandomize=True, database=None, deadline=None, phases=(Phase.generate,),
                    suppress_health_check=list(HealthCheck))
    with pytest.raises(AssertionError, match="not maximal|not the fewest"):
        given(spec_and_budget())(settings(hunt)(lambda case: check(*case)))()
