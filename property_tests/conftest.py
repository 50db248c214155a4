"""Hypothesis profiles: dev (default, quick), ci (loaded when CI is set), nightly (deep), mutation (bench/mutation.py:
the ci profile at a tenth of the examples, run for each mutant, a failure not shrunk)."""
import os

from hypothesis import HealthCheck, Phase, settings

settings.register_profile("dev", max_examples=50, deadline=None)
settings.register_profile("ci", max_examples=100, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow], print_blob=True)
settings.register_profile("mutation", max_examples=10, deadline=None, derandomize=True, database=None,
                          phases=[Phase.explicit, Phase.generate],  # a failure is a kill: no shrinking
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("nightly", max_examples=2000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("FZ3_HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))
