"""The shell's debug mode (`Config(debug_checks=True)`): the core's invariants after each event.

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
