"""Library features that show what a run does or would do: `fz3.plan` (plan, with the fake
tensors and shape guesses it runs on: fake, guesses) and `fz3.timeline` (timeline,
timeline_draw). `fz3.check`, which verifies a model rather than observing it, is fz3/checking/.
The step log and the memory counters the engine reports itself stay in the shell
(fz3/shell/log.py, fz3/shell/memory.py)."""
