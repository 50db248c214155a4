"""Shell: the imperative edge of fz3 (device, hooks, real interpreter) that applies the core's effects."""
