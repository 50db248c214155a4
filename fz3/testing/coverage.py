"""What the Hypothesis machines checked, counted: per invariant, the situations it was checked in.

The machines (param_machine.py, grad_machine.py) and the layout check (layout_check.py) call
`covered(invariant, situation)` each time a check passes; `python -m fz3 verify` prints the
counts, so a run shows what it proved and how often, not only that nothing failed. Counting is a
dict increment: the test suites pay nothing worth measuring for it.
"""
from __future__ import annotations

from collections import Counter

COUNTS: "Counter[tuple[str, str]]" = Counter()


def covered(invariant: str, situation: str) -> None:
    COUNTS[invariant, situation] += 1


def take() -> "Counter[tuple[str, str]]":
    """The counts so far, and a fresh start."""
    out = Counter(COUNTS)
    COUNTS.clear()
    return out
