"""The module-call state machine (fz3/testing/calls_machine.py) under the active profile: the real
fz3/core/calls.py, driven by a simulation of torch autograd, against a naive model. Twice: with
every call's events (as fz3.check sends them), and with the engine's (an inert module's call
inside another takes none); and at ZeRO stages 0-2, where every param is persistent and, at 0
and 1, every trainable param hooked.

    CI=1 pytest property_tests/test_calls_machine.py      # the ci profile, derandomized
"""
from hypothesis import settings

from fz3.testing.calls_machine import CallsMachine, QuietCallsMachine, StagesCallsMachine

TestCallsMachine = CallsMachine.TestCase
TestCallsMachine.settings = settings(stateful_step_count=20)

TestQuietCallsMachine = QuietCallsMachine.TestCase
TestQuietCallsMachine.settings = settings(stateful_step_count=20)

TestStagesCallsMachine = StagesCallsMachine.TestCase
TestStagesCallsMachine.settings = settings(stateful_step_count=20)
