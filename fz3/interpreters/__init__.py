"""Interpreters: run the core's effects (recorder: the effect log; simulated: N ranks in one process)."""
