"""The shell's checks: the core's invariants in debug mode, and the user-error checks.

Debug mode (`fz3.Options(debug_checks=True)`): the core's invariants after each event.

The same check_* functions the unit tests and Hypothesis machines use (fz3/core/invariants*.py);
they walk the whole model, so this is for debugging and the parity tests, not for speed.
"""
from __future__ import annotations

from fz3.core import invariants, invariants_grad
from fz3.core.config import Config


def after_param_event(state, effects, config: Config) -> None:
    invariants.check_state(state)
    invariants.check_live_budget(state, effects, config=config)


def after_grad_event(state, config: Config) -> None:
    invariants_grad.check_grad_state(state, config=config)


def fetched(state, module: int) -> None:
    invariants.check_fetched(state, module)


def quiescent(state) -> None:
    invariants.check_quiescent(state)


def requires_grad_unchanged(tables, trainable: list[bool]) -> None:
    """Raise, naming the params, if any requires_grad differs from what initialize saw: the
    grad partitions, grad hooks and optimizer shards were sized then, so a flipped flag would
    silently leave a param untrained (or train a frozen one without its optimizer state)."""
    changed = [f"{name!r} ({was} -> {p.requires_grad})"
               for name, p, was in zip(tables.names, tables.params, trainable) if p.requires_grad != was]
    if changed:
        raise RuntimeError("requires_grad changed after fz3.initialize: " + ", ".join(changed) +
                           ". fz3 sizes grad partitions and optimizer shards at initialize; set "
                           "requires_grad before it (build a fresh model and engine to change it)")
