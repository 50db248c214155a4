"""fz3's Hypothesis profiles, in one place: property_tests/conftest.py registers each under its
name (pytest --hypothesis-profile=NAME, or HYPOTHESIS_PROFILE=NAME / FZ3_HYPOTHESIS_PROFILE=NAME),
and `python -m fz3 verify --profile NAME` runs the machines under it.

    dev       the default: quick
    ci        loaded when CI is set: derandomized (the same examples every run), the blob printed
    nightly   deep: 2000 examples
    mutation  bench/diagnostics/mutation.py: the ci profile at a tenth of the examples, run for each mutant,
              a failure not shrunk (a failure is a kill)
    hunt      find a bug and shrink it within a minute: no explain phase, short programs
              ([Note: the hunt])

Registering is left to the caller (`register()`): importing this module changes no Hypothesis
setting, as importing fz3 changes nothing (a library leaves the process as it found it).

[Note: the hunt] Hypothesis' shrinker stops at a fixpoint, after 500 successful shrinks, or after
five minutes (engine.MAX_SHRINKING_SECONDS; no setting says otherwise), and then its explain
phase reruns the shrunk case, varying each part, to comment on which parts do not matter. On
fz3's machines each rerun is a program of rules, each a pass or more of a model's calls with
every check on, and the two take minutes: verify's defaults found and shrunk the three bugs of
fz3/testing/planted.py in 14-146 s (issue #46 saw 290-316 s for a planted bug). Measured, the
explain phase is most of it: the hunt's settings with it added took 28-58 s a bug, without it
2-19 s, and programs of 20 rules instead of 8 changed little (2-17 s; bench/diagnostics/hunt.py, 2 cores).
So the hunt leaves out the explain phase and draws many short programs: 300 examples of up to
8 rules, about the rules of verify's 100 of 20, each bug found in under a second and shrunk to
Hypothesis' fixpoint in seconds (bench/RESULTS.md). As a backstop, `python -m fz3 verify
--profile hunt` also stops shrinking after SHRINK_SECONDS["hunt"] (`shrink_budget`), printing
the case as far as it got and saying so; a profile is only settings, so under pytest the hunt
shrinks for as long as Hypothesis does. A bug that needs a longer program than 8 rules is for
`dev`, `ci` and `nightly`, at Hypothesis' 50.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import fz3.testing.extra  # noqa: F401 - Hypothesis, or an ImportError naming the test extra
from hypothesis import HealthCheck, Phase, reporting, settings
from hypothesis.internal.conjecture import engine

HUNT_STEPS = 8
_BASE = settings.get_profile("default")  # Hypothesis' own defaults, whatever profile is loaded now
PROFILES = {
    "dev": settings(_BASE, max_examples=50, deadline=None),
    "ci": settings(_BASE, max_examples=100, deadline=None, derandomize=True,
                   suppress_health_check=[HealthCheck.too_slow], print_blob=True),
    "mutation": settings(_BASE, max_examples=10, deadline=None, derandomize=True, database=None,
                         phases=[Phase.explicit, Phase.generate],  # a failure is a kill: no shrinking
                         suppress_health_check=[HealthCheck.too_slow]),
    "nightly": settings(_BASE, max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow]),
    "hunt": settings(_BASE, max_examples=300, stateful_step_count=HUNT_STEPS, deadline=None,
                     report_multiple_bugs=False,  # the first bug found, shrunk; not every one
                     phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],  # no explain
                     suppress_health_check=list(HealthCheck)),
}
SHRINK_SECONDS = {"hunt": 45}  # verify's budget for shrinking, by profile; others: Hypothesis' five minutes


def register() -> None:
    """Register every profile of PROFILES with Hypothesis under its name."""
    for name, profile in PROFILES.items():
        settings.register_profile(name, parent=profile)


@contextlib.contextmanager
def shrink_budget(seconds: float | None) -> Iterator[list[str]]:
    """Hypothesis' shrinking stopped after `seconds` (None: its own five minutes) while inside;
    yields a list that gets a line saying so each time a shrink was stopped. Hypothesis keeps the
    time limit in a module constant it leaves to be monkeypatched ("make it monkeypatchable",
    engine.py); where it is gone (another Hypothesis), nothing is changed. Its warning when the
    limit hits speaks of five minutes and asks for a report: it is replaced by the line."""
    stopped: list[str] = []
    if seconds is None or not hasattr(engine, "MAX_SHRINKING_SECONDS"):
        yield stopped
        return
    old, outer = engine.MAX_SHRINKING_SECONDS, reporting.current_reporter()

    def said(text: object) -> None:
        if "working to shrink a failing test case" in str(text):
            stopped.append(f"shrinking stopped after {seconds:g} s (the profile's budget): the case may shrink "
                           "further under another profile")
        else:
            outer(text)

    engine.MAX_SHRINKING_SECONDS = seconds
    try:
        with reporting.with_reporter(said):
            yield stopped
    finally:
        engine.MAX_SHRINKING_SECONDS = old
