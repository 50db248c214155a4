"""Hypothesis profiles, defined in fz3/testing/profiles.py and registered here: dev (default, quick),
ci (loaded when CI is set), nightly (deep), mutation (bench/diagnostics/mutation.py: the ci profile at a tenth of
the examples, run for each mutant, a failure not shrunk), hunt (find a planted bug and shrink it
within a minute). Pick one with --hypothesis-profile=NAME, or HYPOTHESIS_PROFILE=NAME (or
FZ3_HYPOTHESIS_PROFILE=NAME) in the environment."""
import os

from hypothesis import settings

from fz3.testing import profiles

profiles.register()
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or os.environ.get("FZ3_HYPOTHESIS_PROFILE")
                      or ("ci" if os.environ.get("CI") else "dev"))
