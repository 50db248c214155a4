"""Library features that show what a run does or would do: `fz3.plan` (plan, with the fake
tensors and shape guesses it runs on: fake, guesses), `fz3.timeline` (timeline,
timeline_draw) and `fz3.check` (check, with check_build, check_draw, check_run, check_watch,
check_compare and check_report; its public signature is fz3/api.py's, which passes
fz3.initialize down). The step log and the memory counters the engine reports itself stay in the
shell (fz3/shell/log.py, fz3/shell/memory.py)."""
