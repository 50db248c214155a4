"""The gradient lifecycle state machine (fz3/testing/grad_machine.py) under the active profile."""
from fz3.testing.grad_machine import GradMachine

TestGradMachine = GradMachine.TestCase
