"""The shell's checks: the core's invariants in debug mode, and the user-error checks.

Debug mode (`fz3.Options(debug_checks=True)`): the core's invariants after each event.

The same check_* functions the unit tests and Hypothesis machines use (fz3/core/invariants*.py);
they walk the whole model, so this is for debugging and the parity tests, not for speed.
"""
from __future__ import annotations

from fz3.core.param import invariants
from fz3.core.grad import invariants as invariants_grad
from fz3.config.config import Config


def after_event(state, effects, config: Config) -> None:
    """After any event on the engine's Lifecycle (fz3/core/calls.py): both lifecycles' states."""
    invariants.check_state(state.params)
    invariants.check_live_budget(state.params, effects, config=config)
    invariants.check_prefetch_reach(state.params, effects, config=config)
    invariants_grad.check_grad_state(state.grads, config=config)
    for frame in state.calls.stack:  # every open call finds its unit gathered
        invariants.check_fetched(state.params, frame.module)


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
