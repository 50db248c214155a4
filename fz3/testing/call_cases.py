"""Hypothesis strategies for the calls machine: models.py's models and programs, made ready for
autograd_sim.py, and the known gaps of fz3/core/calls.py they steer clear of.

    call_cases   models.cases, plus: some params frozen (Model.trainable), each call saving
                 params for backward or not (Call.saves: an embedding on ids saves none), a
                 leaf's call leaving some of its own params unused (Call.skips: experts no token
                 was routed to), 1 or 2 accumulation steps, a reduce bucket small or not
    KNOWN_GAPS   situations calls.py refuses (property_tests/test_calls_gaps.py shows each); the
                 cases avoid them, so the machine can check everything else

Usage:
    from fz3.testing.call_cases import call_cases
    @given(call_cases())
    def test(case): ...
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Iterator

import fz3.testing.extra  # noqa: F401 - Hypothesis, or an ImportError naming the test extra
from hypothesis import strategies as st

from fz3.testing.models import Call, Case, External, Model, configs, models, programs, variants

KNOWN_GAPS = frozenset({"G2"})
"""Situations the machine steers clear of; property_tests/test_calls_gaps.py shows each. G1 and
G3 (and G2 for tied params) were calls.py's errors, found by this machine and fixed; they are
hunted again.

    G2  a leaf module's own param (in no other module) borrowed by another module with grad:
        read off the leaf or returned out of it. Its grads from outside would come after the
        leaf's reduction; calls.py refuses it with an error naming the param (tests there).
        Avoided here: no call reads or returns a leaf's own params
"""


@st.composite
def call_cases(draw, max_variants: int = 2, avoid: frozenset[str] = KNOWN_GAPS) -> Case:
    model = draw(models())
    n = len(model.params)
    flags = draw(st.lists(st.integers(0, 3).map(lambda x: x != 3), min_size=n, max_size=n))
    model = replace(model, trainable=tuple(flags))
    base = draw(programs(model))
    extra = draw(st.lists(variants(model, base), max_size=max_variants))
    config = draw(configs()).replace(gradient_accumulation_steps=draw(st.sampled_from([1, 2])),
                                     reduce_bucket_size=draw(st.sampled_from([500_000_000, 8])))
    def rewrite(c: Call) -> Call:
        c = replace(c, saves=draw(st.integers(0, 3)) != 3)
        _, own, leaf = model.modules[c.module]
        if leaf and own and draw(st.booleans()):  # some experts get no token in this call
            c = replace(c, skips=tuple(sorted(draw(st.sets(st.sampled_from(own), max_size=len(own))))))
        return c

    out = tuple(_rewrite(p, rewrite) for p in (base, *extra))
    if "G2" in avoid:
        homes: dict[int, list[bool]] = {}
        for _, ps, leaf in model.modules:
            for p in ps:
                homes.setdefault(p, []).append(leaf)
        own = {p for p, h in homes.items() if h == [True]}  # a leaf's own: in no other module
        out = tuple(_leaf_params_unused_outside(model, p, own) for p in out)
    return Case(model, config, out)


def forward_ticks(call: Call) -> int:
    """enter + leave events of a forward of `call`: where a raising pass may stop."""
    return 2 * sum(1 for _ in _calls(call))


def _leaf_params_unused_outside(model: Model, call: Call, inside: set[int]) -> Call:
    """G2: no leaf returns its own params, no call reads a leaf's own params."""
    body: list[Call | External] = []
    for item in call.body:
        if isinstance(item, Call):
            body.append(_leaf_params_unused_outside(model, item, inside))
        elif set(item.params) - inside:
            body.append(External(tuple(p for p in item.params if p not in inside)))
    leaf = model.modules[call.module][2]
    return replace(call, body=tuple(body), returns=() if leaf else call.returns)


def _calls(call: Call) -> Iterator[Call]:
    """The calls of a program, pre-order."""
    yield call
    for item in call.body:
        if isinstance(item, Call):
            yield from _calls(item)


def _rewrite(call: Call, f: Callable[[Call], Call]) -> Call:
    """`f` applied to every call of a program, children first."""
    body = tuple(_rewrite(i, f) if isinstance(i, Call) else i for i in call.body)
    return f(replace(call, body=body))
