"""The hunt profile, measured: each of three planted bugs (fz3/testing/planted.py: one in the param
lifecycle, one in the grad lifecycle, one in the module calls) found and shrunk by
`python -m fz3 verify --profile hunt --patch ...` within a minute ([Note: the hunt] in
fz3/testing/profiles.py).

    python bench/diagnostics/hunt.py                # 3 runs of each bug, seeds 0, 1, 2
    python bench/diagnostics/hunt.py --runs 1 --bugs release --show
    python bench/diagnostics/hunt.py --baseline     # also verify's defaults on the same bugs and seeds

Per bug and run (seed s):
    found    the generate phase alone under the hunt profile, the same seed (so the same examples)
             until the first failure: how long finding it takes
    shrunk   verify(machines=(machine,), profile="hunt", patches=[planted], seed=s), as the command
             runs it: found, then shrunk; the wall time a user waits for the shrunk case
    steps    the rules of the shrunk case, its setup (the initialize rule) included: its regression
             test's steps, invariant checks left out
Each run also checks that the failure is the planted one (its message matches Planted.caught) and
that the shrunk case printed as a regression test. Both timings are in this process, after its
imports (`python -m fz3 verify` adds its start, ~3 s, to each). Prints a markdown table for
bench/RESULTS.md; --show also prints each shrunk case.
"""
from __future__ import annotations

import argparse
import datetime
import inspect
import os
import platform
import re
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import hypothesis  # noqa: E402
from hypothesis import Phase, settings  # noqa: E402
from hypothesis.stateful import run_state_machine_as_test  # noqa: E402

from fz3.testing.patch import patched  # noqa: E402
from fz3.testing.planted import PLANTED  # noqa: E402
from fz3.testing.profiles import PROFILES  # noqa: E402
from fz3.testing.verify import MACHINE_CLASSES, _runner, verify  # noqa: E402


def found_in(bug: str, seed: int) -> float:
    """Seconds of the hunt's generate phase until the planted bug fails the machine."""
    planted = PLANTED[bug]
    machine = _runner(planted.machine)
    find = settings(PROFILES["hunt"], database=None, phases=[Phase.explicit, Phase.generate])
    start = time.perf_counter()
    with patched(planted.target, planted.replacement):
        try:
            run_state_machine_as_test(hypothesis.seed(seed)(lambda: machine()), settings=find)
        except Exception as e:  # noqa: BLE001 - the failure we hunt
            assert re.search(planted.caught, str(e)), f"{bug}: another failure: {e}"
        else:
            raise AssertionError(f"{bug} (seed {seed}): not found in {find.max_examples} examples")
    return time.perf_counter() - start


def shrunk_in(bug: str, seed: int, profile: str | None = "hunt") -> tuple[float, int | None, str | None]:
    """(seconds, steps of the shrunk case, its regression test) of verify under `profile` (None:
    verify's defaults, 100 examples of up to 20 rules); steps None: not found."""
    planted = PLANTED[bug]
    start = time.perf_counter()
    report = verify(machines=(planted.machine,), profile=profile, patches=[planted.patch], seed=seed)
    took = time.perf_counter() - start
    if report.failure is None:
        assert profile is None, f"{bug} (seed {seed}): the hunt passed it"
        return took, None, None
    error = report.failure[1]
    errors = error.exceptions if isinstance(error, BaseExceptionGroup) else (error,)  # several distinct bugs
    assert any(re.search(planted.caught, str(e)) for e in errors), f"{bug}: another failure: {error}"
    assert report.regression, f"{bug}: no regression test printed"
    return took, steps(report.regression, planted.machine), report.regression


def steps(regression: str, machine: str) -> int:
    """The rules (and initialize rules) a printed regression test calls; invariants and teardown
    are not steps."""
    cls = _runner(machine)
    invariants = {n for n, f in inspect.getmembers(cls) if hasattr(f, "hypothesis_stateful_invariant")}
    called = re.findall(r"^    state\.(\w+)\(", regression, re.M)
    return sum(1 for name in called if name not in invariants and name != "teardown")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--bugs", default=",".join(PLANTED), help=f"comma-separated, of {', '.join(PLANTED)}")
    parser.add_argument("--show", action="store_true", help="print each shrunk case")
    parser.add_argument("--baseline", action="store_true", help="also time verify's defaults (no profile: 100 "
                        "examples of up to 20 rules, the explain phase on), found and shrunk, for comparison")
    args = parser.parse_args()
    hunt = PROFILES["hunt"]
    print(f"{datetime.date.today()}: python bench/diagnostics/hunt.py {' '.join(sys.argv[1:])}; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus, python {platform.python_version()}, "
          f"hypothesis {hypothesis.__version__}; "
          f"hunt profile: {hunt.max_examples} examples, {hunt.stateful_step_count} rules\n")
    rows = []
    for bug in args.bugs.split(","):
        planted = PLANTED[bug]
        found, shrunk, counts, base = [], [], [], []
        for seed in range(args.runs):
            found.append(found_in(bug, seed))
            took, n, regression = shrunk_in(bug, seed)
            shrunk.append(took)
            counts.append(n)
            print(f"{bug} seed {seed}: found in {found[-1]:.1f} s, found and shrunk in {took:.1f} s, {n} steps",
                  file=sys.stderr, flush=True)
            if args.show:
                print(regression, file=sys.stderr)
            if args.baseline:
                took, n, _ = shrunk_in(bug, seed, profile=None)
                base.append((took, n))
                said = f"found and shrunk it in {took:.1f} s, {n} steps" if n else f"passed it in {took:.1f} s"
                print(f"{bug} seed {seed}: verify's defaults {said}", file=sys.stderr, flush=True)
        rows.append((f"{bug}: {planted.target} ({planted.lifecycle})", MACHINE_CLASSES[planted.machine][1],
                     found, shrunk, counts, base))
    extra = " verify's defaults: found and shrunk in s (steps; - not found) |" if args.baseline else ""
    print(f"| bug | machine | found in s | found and shrunk in s | steps in the shrunk case (setup included) |{extra}")
    print("|---|---|---|---|---|" + ("---|" if args.baseline else ""))
    for bug, machine, found, shrunk, counts, base in rows:
        cell = f" {_runs([t for t, _ in base])} ({', '.join(str(n or '-') for _, n in base)}) |" if base else ""
        print(f"| {bug} | {machine} | {_runs(found)} | {_runs(shrunk)} | {', '.join(map(str, counts))} |{cell}")


def _runs(xs: list[float]) -> str:
    """Each run's seconds, and the median when there are several."""
    each = ", ".join(f"{x:.1f}" for x in xs)
    return each if len(xs) == 1 else f"{each} (median {statistics.median(xs):.1f})"


if __name__ == "__main__":
    main()
