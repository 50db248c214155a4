"""A shrunk Hypothesis failure as a pytest function to paste: the house rule "a shrunk failure
becomes a permanent regression test".

Hypothesis prints a failing state machine as the program that broke it: `state = Machine()`,
then each step (`state.one_pass(again=0, ...)`) and each invariant check, and for a rule that
draws from `st.data()` the values it drew (`Draw 1 (reached): frozenset({0})`) before the step,
with `data=data(...)` in the step. `regression_test` turns that program into a test function:
the steps as they are, each `data=data(...)` replaced by `Draws(...)` holding the values drawn.
Replayed, the steps drive the core through the machine with every check of the machine on, so
the test fails while the bug is there and passes once it is gone. The test runs under
`@replayed`, once inside Hypothesis, because the machines `note()` as they go. A failing
`@given` check (fz3/testing/layout_check.py) prints as a call, which becomes the test's body.

What is read is Hypothesis' printed account (the notes on the error), not its internals: if a
Hypothesis version prints otherwise, `regression_test` gives None and verify says it has no case
to print, pointing at Hypothesis' own account; the check that the text runs is
tests/test_verify_regression.py.

    from fz3.testing.regression import regression_test
    try:
        run_state_machine_as_test(GradMachine)
    except AssertionError as e:
        print(regression_test(e, name="test_grads_regression",
                              where={"GradMachine": "fz3.testing.grad_machine"}))

`python -m fz3 verify` prints one above its table when a machine fails.
"""
from __future__ import annotations

import ast
import functools
import re
import textwrap
from typing import Callable, Mapping

import fz3.testing.extra  # noqa: F401 - Hypothesis, or an ImportError naming the test extra
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

PREFIXES = ("Failing test case: ", "Falsifying example: ")  # Hypothesis' words, newest first
DRAW = re.compile(r"Draw \d+(?: \(.*?\))?: (.*?)(?:  # [^\n]*)?", re.S)  # the explain phase adds a comment
# the names a printed value may use, and where they live
KNOWN = {"Case": "fz3.testing.models", "Model": "fz3.testing.models", "Call": "fz3.testing.models",
         "External": "fz3.testing.models", "Config": "fz3.config.config", "Draws": "fz3.testing.regression",
         "OffloadOptimizer": "fz3.config.offload", "OffloadParam": "fz3.config.offload", "Aio": "fz3.config.offload",
         "replayed": "fz3.testing.regression"}


def replayed(test: Callable[[], None]) -> Callable[[], None]:
    """`test` (no arguments) run once inside Hypothesis, as its one explicit example: the
    machines `note()` what they do, which Hypothesis allows only inside a test, and prints the
    notes when it fails. No generation, no shrinking, no example database."""
    once = settings(database=None, deadline=None, phases=[Phase.explicit], suppress_health_check=list(HealthCheck))(
        example(None)(given(st.none())(lambda _: test())))

    @functools.wraps(test)
    def run() -> None:
        once()
    return run


class Draws:
    """Stands in for `st.data()` in a replayed step: hands out the values the failing run drew,
    in order."""

    def __init__(self, *values: object) -> None:
        self.values = list(values)

    def draw(self, strategy: object, label: object = None) -> object:
        if not self.values:
            raise AssertionError(f"the step draws more ({label or strategy!r}) than the failing run drew: the "
                                 "machine changed since this test was printed")
        return self.values.pop(0)

    def __repr__(self) -> str:
        return f"Draws({', '.join(map(repr, self.values))})"


def program(notes: list[str]) -> list[str] | None:
    """The steps of a failing state machine's printed program, `data=data(...)` replaced by
    the values drawn; None if the notes hold no program."""
    steps: list[str] = []
    drawn: list[str] = []
    for entry in notes:
        if entry.startswith("state = "):
            steps, drawn = [entry], []
        elif not steps:
            continue
        elif m := DRAW.fullmatch(entry):
            drawn.append(m.group(1))
        elif entry.startswith("state."):
            if "data=data(...)" in entry:
                entry = entry.replace("data=data(...)", f"data=Draws({', '.join(drawn)})")
                drawn = []
            steps.append(entry)
    return steps or None


def call(notes: list[str]) -> str | None:
    """The failing call of a `@given` test, as printed."""
    for entry in notes:
        for prefix in PREFIXES:
            if entry.startswith(prefix) and "<state machine>" not in entry:
                return entry[len(prefix):].strip()
    return None


def regression_test(error: BaseException, *, name: str, where: Mapping[str, str]) -> str | None:
    """A pytest function named `name` that replays the shrunk failure Hypothesis attached to
    `error` (its notes); `where` maps the machine class or check function it calls to its
    module. None if the error carries no failing case."""
    if isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    notes = [n for n in getattr(error, "__notes__", []) if isinstance(n, str)]
    body = program(notes) or ([c] if (c := call(notes)) else None)
    if body is None:
        return None
    code = "\n".join(body)
    try:
        used = {n.id for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Name)} | {"replayed"}
    except SyntaxError:
        return None  # a value whose repr is not Python
    homes, by_module = {**KNOWN, **where}, {}
    for n in sorted(used & set(homes)):
        by_module.setdefault(homes[n], []).append(n)
    imports = [f"from {m} import {', '.join(ns)}" for m, ns in sorted(by_module.items())]
    first = (str(error).strip().splitlines() or [""])[0]
    said = textwrap.shorten(f"{type(error).__name__}: {first}", 90).replace("\\", "\\\\").replace('"""', "'''")
    return "\n".join(imports + ["", "", "@replayed", f"def {name}():",
                                f'    """Shrunk by Hypothesis from {said}"""',
                                textwrap.indent(code, "    ")]) + "\n"
