"""Only fz3/core/param/state.py knows that a param or module slot is a tuple, and only
fz3/core/param/trace.py builds a TraceState (issue #26, point 2).

Every other file reads a slot by a named accessor (`ParamState.status(p)`, `Txn.users(p)`, ...)
and changes it by a named move (`Txn.use`, `Txn.open_call`, ...), so a column added to a row, or
a field added to TraceState, is written in one place and kept everywhere else. Read off the
source of fz3/, the tests, the examples and the benchmarks.
"""
from __future__ import annotations

import ast
from pathlib import Path

from fz3.config.config import Config
from fz3.core.param.fetch import fetch
from fz3.core.ids import TraceMode
from fz3.core.param.release import release
from fz3.core.spec import build_spec
from fz3.core.param.state import initial_state
from fz3.core.param.step import reset_step

ROOT = Path(__file__).resolve().parents[1]
STATE, TRACE = "fz3/core/param/state.py", "fz3/core/param/trace.py"
ROW_VECTORS = {"param_rows", "module_rows"}  # ParamState's fields holding the rows


def sources():
    for folder in ("fz3", "tests", "property_tests", "examples", "bench"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if any(part.startswith(".") for part in path.relative_to(ROOT).parts):
                continue  # bench/.env (bench/setup_env.sh's virtualenv) and other hidden folders
            if path.name.endswith("_teeth.py"):
                continue  # planted bugs reach into the rows on purpose (a forgotten old row, ...)
            yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(), str(path))


def offences(rel: str, tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        where = f"{rel}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.ImportFrom) and node.module == "fz3.core.param.state":
            found += [f"{where} imports {a.name}, private to {STATE}"
                      for a in node.names if a.name.startswith("_")]
        if rel != STATE and isinstance(node, ast.Attribute):
            if node.attr in ROW_VECTORS:
                found.append(f"{where} reads .{node.attr}: the rows are {STATE}'s; use a named read")
            if node.attr.startswith("_") and not node.attr.startswith("__") and \
                    isinstance(node.value, ast.Name) and node.value.id == "tx":
                found.append(f"{where} reaches into the transaction (tx.{node.attr})")
        if rel != TRACE and isinstance(node, ast.Call) and (
                getattr(node.func, "id", None) == "TraceState" or getattr(node.func, "attr", None) == "TraceState"):
            found.append(f"{where} builds a TraceState: use {TRACE}'s helpers (advanced, invalidated, ...)")
    return found


def test_no_file_but_state_py_knows_the_row_encoding():
    found = [o for rel, tree in sources() for o in offences(rel, tree)]
    assert not found, "\n".join(found)


def test_the_check_sees_each_kind_of_offence():
    """The scanner is not vacuous: each pattern it forbids, planted in a file, is reported."""
    planted = ast.parse("from fz3.core.param.state import _USERS\n"
                        "n = st.param_rows[0][_USERS]\n"
                        "m = tx._mods[1]\n"
                        "t = TraceState(0, 0, (), None, 0, 0)\n")
    found = offences("fz3/core/param/fetch.py", planted)
    assert len(found) == 4, found
    assert any("_USERS" in o for o in found) and any(".param_rows" in o for o in found)
    assert any("tx._mods" in o for o in found) and any("builds a TraceState" in o for o in found)


def test_a_prefetch_keeps_every_trace_field():
    """A fetch that prefetches moves the cursor and the step and leaves the other fields of the
    trace as they were (the prefetch once rebuilt TraceState field by field, so a field added
    to it was reset on every prefetch)."""
    spec = build_spec([("a", 4), ("b", 4), ("c", 4)],
                      [("root", [], False), ("x", [0], False), ("y", [1], False), ("z", [2], False)],
                      world_size=1, persistence_threshold=0)
    config = Config(prefetch_bucket_size=100, max_live_parameters=100)
    st = initial_state(spec)
    for _ in range(2):  # record one pass, then freeze it into a plan
        st, _ = reset_step(st, config=config)
        for m in (1, 2, 3):
            st, _ = fetch(st, m, forward=True, config=config)
            st, _ = release(st, m, config=config)
    st, _ = reset_step(st, config=config)
    assert st.trace.mode is TraceMode.COMPLETE
    marked = st._replace(trace=st.trace._replace(parked=(("eval", st.trace),), departure=(7, 8, 9)))
    after, effects = fetch(marked, 1, forward=True, config=config)
    assert any(getattr(e, "prefetch", False) for e in effects), effects
    assert after.trace.cursor > marked.trace.cursor and after.trace.step_id == 1
    for field in ("mode", "plan", "invalidations", "kind", "parked", "departure"):
        assert getattr(after.trace, field) == getattr(marked.trace, field), field
