"""Reusable test machinery: Hypothesis state machines and the naive models they are checked against."""
