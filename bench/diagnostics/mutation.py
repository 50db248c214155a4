"""Mutation score of fz3's core and data plane: mutmut, in a throwaway clone, against fast tests.

    python3 bench/diagnostics/mutation.py                    # every file of fz3/core and fz3/data
    python3 bench/diagnostics/mutation.py --paths fz3/data/layout.py --tests tests/test_layout.py ...
    python3 bench/diagnostics/mutation.py ... --md bench/RESULTS.md      # also write the section there
    python3 bench/diagnostics/mutation.py --rerun --md bench/RESULTS.md  # after adding tests: only the
                                                                         # mutants not killed

mutmut (installed into bench/.env with hypothesis, pytest and pytest-timeout, as the peers are:
never a dependency of fz3) copies the code into mutants/, makes every mutant of `--paths`
(operators, constants, conditions, returns) and runs, for each, the selected tests that cover the
mutated function, fastest first, stopping at the first failure. A mutant is killed when a test
fails, survives when all pass; "no tests": no selected test runs that function. The Hypothesis
properties run under the `mutation` profile (property_tests/conftest.py: derandomized, 10
examples, no shrinking). The run happens in a clone of the repository's HEAD under /tmp, so the
work tree is never touched. Prints the score per file and every survivor's diff, marking those
that change only a message's wording; with --md, replaces (or appends) the "Mutation score"
section of that file.

Time: a survivor costs every covering test, the machines included (~10 s), a mutant killed by
a unit test well under a second; the whole of fz3/core and fz3/data (~3400 mutants) took 91 min on
2 cores (bench/RESULTS.md). --rerun copies the work tree's tests into the clone and runs only the
mutants not killed, so a new test's kills are counted without the whole run again.
"""
from __future__ import annotations

import argparse
import ast
import datetime
import difflib
import functools
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)  # bench/: its .env
ROOT = os.path.dirname(BENCH)
ENV = os.path.join(BENCH, ".env", "bin")
FAST_TESTS = ["tests/test_layout.py", "tests/test_collectives.py", "tests/test_partition.py", "tests/test_spec.py",
              "tests/test_pvec.py", "tests/test_fetch.py", "tests/test_release.py", "tests/test_backward.py",
              "tests/test_step.py", "tests/test_trace.py", "tests/test_hold.py", "tests/test_grads.py",
              "tests/test_epilogue.py", "tests/test_calls.py", "tests/test_effects.py", "tests/test_simulated.py",
              "tests/test_config.py", "tests/test_pool.py", "tests/test_invariants_grad.py", "tests/test_tables.py",
              "tests/test_core_is_pure.py", "tests/test_invariants.py", "tests/test_state.py",
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


def mutmut(workdir: str, args: list[str], max_children: int) -> None:
    # the `mutation` Hypothesis profile: derandomized as in CI, a tenth of its examples, no shrinking (each mutant
    # runs the machines again); one OpenMP thread, as mutmut forks a worker per mutant from a process that ran torch
    env = dict(os.environ, CI="1", FZ3_HYPOTHESIS_PROFILE="mutation", OMP_NUM_THREADS="1")
    with open(os.path.join(workdir, "mutmut.log"), "a") as log:  # progress: tail -f it
        subprocess.run([os.path.join(ENV, "mutmut"), "run", f"--max-children={max_children}", *args], cwd=workdir,
                       env=env, stdout=log, stderr=subprocess.STDOUT)


def results(workdir: str) -> dict[str, str]:
    out = subprocess.run([os.path.join(ENV, "mutmut"), "results", "--all", "true"], cwd=workdir,
                         capture_output=True, text=True, check=True).stdout
    return dict(re.findall(r"^\s*(\S+): (.+)$", out, re.M))


def run(paths: list[str], tests: list[str], workdir: str, max_children: int) -> dict[str, str]:
    """-> {mutant name: status} after a full mutmut run in a fresh clone at `workdir`."""
    subprocess.run(["rm", "-rf", workdir], check=True)
    subprocess.run(["git", "clone", "-q", ROOT, workdir], check=True)
    with open(os.path.join(workdir, "setup.cfg"), "w") as f:
        f.write(setup_cfg(paths, tests))
    mutmut(workdir, [], max_children)
    return results(workdir)


def rerun(workdir: str, tests: list[str], max_children: int) -> dict[str, str]:
    """Every mutant not killed in an earlier run at `workdir`, again, against the work tree's current tests and
    selection (mutmut collects coverage for the new tests only). The code under mutation must be unchanged since
    that run: only tests were added."""
    for d in ("tests", "property_tests"):
        for dest in (workdir, os.path.join(workdir, "mutants")):
            subprocess.run(["rm", "-rf", os.path.join(dest, d)], check=True)
            subprocess.run(["cp", "-r", os.path.join(ROOT, d), dest], check=True)
    with open(os.path.join(workdir, "setup.cfg")) as f:
        paths = re.search(r"source_paths=\n((?:    .*\n)+)", f.read()).group(1).split()
    with open(os.path.join(workdir, "setup.cfg"), "w") as f:
        f.write(setup_cfg(paths, tests))
    # mutmut drops every result when the test selection changes; added test files change no earlier verdict (a
    # killed mutant stays killed), so record the new selection as the one the results were taken with
    fingerprint = json.loads(subprocess.run(
        [os.path.join(ENV, "python"), "-c", "import json; from mutmut.configuration import config; "
         "print(json.dumps(config().config_fingerprint()))"], cwd=workdir, capture_output=True, text=True,
        check=True).stdout)
    stats_path = os.path.join(workdir, "mutants", "mutmut-stats.json")
    with open(stats_path) as f:
        stats = json.load(f)
    stats["config_fingerprint"] = fingerprint
    with open(stats_path, "w") as f:
        json.dump(stats, f)
    open_ = [name for name, status in results(workdir).items() if status != "killed"]
    if open_:
        mutmut(workdir, open_, max_children)
    return results(workdir)


@functools.lru_cache(maxsize=None)
def functions(path: str) -> dict[str, str]:
    """{name: source} of every function in the mutated module at `path`."""
    with open(path) as f:
        src = f.read()
    lines = src.splitlines()
    return {n.name: "\n".join(lines[n.lineno - 1:n.end_lineno]) for n in ast.walk(ast.parse(src))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def diff(workdir: str, name: str) -> str:
    """The mutant's changed lines, from the mutated module mutmut wrote (every mutant is a copy of the function)."""
    module, func = name.rsplit(".", 1)
    funcs = functions(os.path.join(workdir, "mutants", *module.split(".")) + ".py")
    base = func.rsplit("__mutmut_", 1)[0]
    orig, mutant = funcs[base + "__mutmut_orig"], funcs[func].replace(func, base + "__mutmut_orig", 1)
    return "\n".join(l for l in difflib.unified_diff(orig.splitlines(), mutant.splitlines(), lineterm="", n=0)
                     if l.startswith(("-", "+")) and not l.startswith(("---", "+++")))


def wording_only(d: str) -> bool:
    """True when the mutant changes only the text of a message: string literals of several words wrapped in XX or
    with their case changed, nothing else on the line (a key or a one-word value is not wording)."""
    minus = [l[1:] for l in d.splitlines() if l.startswith("-")]
    plus = [l[1:] for l in d.splitlines() if l.startswith("+")]
    if not minus or len(minus) != len(plus):
        return False
    for a, b in zip(minus, plus):
        for la, lb in zip(re.findall(r'"[^"]*"', a), re.findall(r'"[^"]*"', b)):
            if la != lb and len(la.split()) < 3:
                return False
        norm = re.sub(r'"XX(.*?)XX"', r'"\1"', b)
        if norm.lower() != a.lower():
            return False
    return True


def report(results: dict[str, str], workdir: str, command: str, started: str, minutes: float) -> str:
    by_file: dict[str, Counter] = {}
    diffs = {name: diff(workdir, name) for name, status in results.items() if status != "killed"}
    wording = {name for name, d in diffs.items() if results[name] == "survived" and wording_only(d)}
    for name, status in results.items():
        module = re.split(r"\.x[_ǁ]", name)[0]
        by_file.setdefault(module, Counter())[status] += 1
        by_file[module]["wording"] += name in wording
    lines = [SECTION, "", f"`{command}`, {started}, {minutes:.1f} min, fz3 at "
             + subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip() + ".", "",
             "| module | mutants | killed | survived (of which wording) | no tests | other | score (killed ÷ mutants) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    total = Counter()
    for module, c in sorted(by_file.items()):
        n = sum(v for k, v in c.items() if k != "wording")
        other = n - c["killed"] - c["survived"] - c["no tests"]
        lines.append(f"| {module} | {n} | {c['killed']} | {c['survived']} ({c['wording']}) | {c['no tests']} | "
                     f"{other} | {c['killed'] / n:.1%} |")
        total.update(c)
        total["n"] += n
    lines.append(f"| **all** | {total['n']} | {total['killed']} | {total['survived']} ({total['wording']}) | "
                 f"{total['no tests']} | {total['n'] - total['killed'] - total['survived'] - total['no tests']} | "
                 f"**{total['killed'] / total['n']:.1%}** |")
    lines += ["", "Survivors and untested mutants (the diff of each); *wording*: the mutant changes only the text of "
              "a message, which the tests match only where it names the offending value:", ""]
    for name, d in sorted(diffs.items()):
        tag = "survived, wording" if name in wording else results[name]
        lines += [f"- `{name}` ({tag}):", "  ```", *("  " + l for l in d.splitlines()), "  ```"]
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
    ap.add_argument("--rerun", action="store_true",
                    help="keep --workdir's results and run again only the mutants not killed, against the current tests")
    ap.add_argument("--md", help="write the section into this markdown file")
    args = ap.parse_args()
    if not os.path.exists(os.path.join(ENV, "mutmut")):
        sys.exit(f"no mutmut in {ENV}: {ENV}/pip install mutmut hypothesis pytest pytest-timeout")
    started, t0 = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"), time.time()
    results = (rerun(args.workdir, args.tests, args.max_children) if args.rerun
               else run(args.paths, args.tests, args.workdir, args.max_children))
    if not results:
        sys.exit("mutmut produced no results (run it by hand in the workdir with debug=true in setup.cfg)")
    text = report(results, args.workdir, "python3 bench/diagnostics/mutation.py " + " ".join(sys.argv[1:]), started,
                  (time.time() - t0) / 60)
    print(text)
    if args.md:
        write_section(args.md, text)


if __name__ == "__main__":
    main()
