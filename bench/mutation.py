"""Mutation score of fz3's core and data plane: mutmut, in a throwaway clone, against fast tests.

    python3 bench/mutation.py                               # every file of fz3/core and fz3/data
    python3 bench/mutation.py --paths fz3/data/layout.py --tests tests/test_layout.py ...
    python3 bench/mutation.py ... --md bench/RESULTS.md     # also write the section there

mutmut (installed into bench/.env with hypothesis, pytest and pytest-timeout, as the peers are:
never a dependency of fz3) copies the code into mutants/, makes every mutant of `--paths`
(operators, constants, conditions, returns) and runs, for each, the selected tests that cover the
mutated function. A mutant is killed when a test fails, survives when all pass; "no tests": no
selected test runs that function. The run happens in a clone of the repository's HEAD under
/tmp, so the work tree is never touched. Prints the score per file and every survivor's diff;
with --md, replaces (or appends) the "Mutation score" section of that file.

Time: about 7 mutants a second against the layout tests; a file whose tests are the Hypothesis
machines costs the machines' run time per mutant (seconds), so the whole core is hours on 2 cores.
"""
from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import sys
import time
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ENV = os.path.join(HERE, ".env", "bin")
FAST_TESTS = ["tests/test_layout.py", "tests/test_collectives.py", "tests/test_partition.py", "tests/test_spec.py",
              "tests/test_pvec.py", "tests/test_fetch.py", "tests/test_release.py", "tests/test_backward.py",
              "tests/test_step.py", "tests/test_trace.py", "tests/test_hold.py", "tests/test_grads.py",
              "tests/test_epilogue.py", "tests/test_calls.py", "tests/test_effects.py", "tests/test_simulated.py",
              "tests/test_config.py", "tests/test_pool.py", "tests/test_invariants_grad.py", "tests/test_tables.py",
              "tests/test_core_is_pure.py",
              "property_tests/test_layout_properties.py", "property_tests/test_param_machine.py",
              "property_tests/test_grad_machine.py", "property_tests/test_grad_properties.py",
              "property_tests/test_calls_machine.py", "property_tests/test_trace_safety.py",
              "property_tests/test_interpreters_differential.py"]
SECTION = "## Mutation score (issue #14)"


def setup_cfg(paths: list[str], tests: list[str]) -> str:
    lines = ["[mutmut]", "source_paths="] + [f"    {p}" for p in paths] + ["also_copy="]
    lines += [f"    {p}" for p in ("fz3/", "tests/", "property_tests/", "pyproject.toml")]
    lines += ["pytest_add_cli_args_test_selection="] + [f"    {t}" for t in tests]
    return "\n".join(lines) + "\n"


def run(paths: list[str], tests: list[str], workdir: str, max_children: int) -> dict[str, str]:
    """-> {mutant name: status} after a full mutmut run in a fresh clone at `workdir`."""
    subprocess.run(["rm", "-rf", workdir], check=True)
    subprocess.run(["git", "clone", "-q", ROOT, workdir], check=True)
    with open(os.path.join(workdir, "setup.cfg"), "w") as f:
        f.write(setup_cfg(paths, tests))
    # the `mutation` Hypothesis profile: derandomized as in CI, a quarter of its examples (each mutant runs the
    # machines again); one OpenMP thread, as mutmut forks a worker per mutant from a process that ran torch
    env = dict(os.environ, CI="1", FZ3_HYPOTHESIS_PROFILE="mutation", OMP_NUM_THREADS="1")
    with open(os.path.join(workdir, "mutmut.log"), "w") as log:  # progress: tail -f it
        subprocess.run([os.path.join(ENV, "mutmut"), "run", f"--max-children={max_children}"], cwd=workdir, env=env,
                       stdout=log, stderr=subprocess.STDOUT)
    out = subprocess.run([os.path.join(ENV, "mutmut"), "results", "--all", "true"], cwd=workdir,
                         capture_output=True, text=True, check=True).stdout
    return dict(re.findall(r"^\s*(\S+): (.+)$", out, re.M))


def diff(workdir: str, name: str) -> str:
    out = subprocess.run([os.path.join(ENV, "mutmut"), "show", name], cwd=workdir, capture_output=True,
                         text=True).stdout
    return "\n".join(l for l in out.splitlines() if l.startswith(("-", "+")) and not l.startswith(("---", "+++")))


def report(results: dict[str, str], workdir: str, command: str, started: str, minutes: float) -> str:
    by_file: dict[str, Counter] = {}
    for name, status in results.items():
        module = re.split(r"\.x[_ǁ]", name)[0]
        by_file.setdefault(module, Counter())[status] += 1
    lines = [SECTION, "", f"`{command}`, {started}, {minutes:.1f} min, fz3 at "
             + subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip() + ".", "",
             "| module | mutants | killed | survived | no tests | other | score (killed ÷ mutants) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for module, c in sorted(by_file.items()):
        n = sum(c.values())
        other = n - c["killed"] - c["survived"] - c["no tests"]
        lines.append(f"| {module} | {n} | {c['killed']} | {c['survived']} | {c['no tests']} | {other} | "
                     f"{c['killed'] / n:.1%} |")
    lines += ["", "Survivors and untested mutants (the diff of each):", ""]
    for name, status in sorted(results.items()):
        if status != "killed":
            lines += [f"- `{name}` ({status}):", "  ```", *("  " + l for l in diff(workdir, name).splitlines()),
                      "  ```"]
    return "\n".join(lines) + "\n"


def write_section(md: str, text: str) -> None:
    with open(md) as f:
        s = f.read()
    if SECTION in s:
        start = s.index(SECTION)
        end = s.find("\n## ", start + len(SECTION))
        s = s[:start] + text + (s[end + 1:] if end >= 0 else "")
    else:
        s = s.rstrip("\n") + "\n\n" + text
    with open(md, "w") as f:
        f.write(s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--paths", nargs="+", default=["fz3/core/", "fz3/data/"])
    ap.add_argument("--tests", nargs="+", default=FAST_TESTS)
    ap.add_argument("--workdir", default="/tmp/fz3-mutation")
    ap.add_argument("--max-children", type=int, default=os.cpu_count(), help="mutants run at once")
    ap.add_argument("--md", help="write the section into this markdown file")
    args = ap.parse_args()
    if not os.path.exists(os.path.join(ENV, "mutmut")):
        sys.exit(f"no mutmut in {ENV}: {ENV}/pip install mutmut hypothesis pytest pytest-timeout")
    started, t0 = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"), time.time()
    results = run(args.paths, args.tests, args.workdir, args.max_children)
    if not results:
        sys.exit("mutmut produced no results (run it by hand in the workdir with debug=true in setup.cfg)")
    text = report(results, args.workdir, "python3 bench/mutation.py " + " ".join(sys.argv[1:]), started,
                  (time.time() - t0) / 60)
    print(text)
    if args.md:
        write_section(args.md, text)


if __name__ == "__main__":
    main()
