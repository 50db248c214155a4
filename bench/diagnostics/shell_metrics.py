"""How much state and policy the shell and the interpreter hold, at a git revision.

    python3 bench/diagnostics/shell_metrics.py [REV ...]      (default: HEAD and the work tree)

For the engine (fz3/shell/engine.py: Engine) and the real interpreter (fz3/interpreters/dist.py:
DistInterpreter), read off the source with `ast`:

    mutable fields   attributes of self assigned outside __init__, or mutated in place outside
                     it (self.x.add(...), self.x[k] = ..., self.x += ...): the cells that change
                     while training runs (a cell of an object it holds, self.store.x, is that
                     object's)
    branch points    if / elif / for / while / conditional expressions / match cases / except
                     handlers / extra operands of and-or, inside the class's methods
    long functions   methods over 40 lines
"""
from __future__ import annotations

import ast
import subprocess
import sys

ROOT = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True).stdout.strip()
TARGETS = (("fz3/shell/engine.py", "Engine"), ("fz3/interpreters/dist.py", "DistInterpreter"))
MUTATORS = {"add", "append", "appendleft", "clear", "discard", "extend", "insert", "pop", "popleft",
            "remove", "setdefault", "update"}


def self_attr(node: ast.AST) -> str | None:
    """`x` for self.x or self.x[...] (a cell of this object, not of an object it holds)."""
    while isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


def targets_of(sub: ast.AST) -> list[ast.AST]:
    if isinstance(sub, ast.Assign):
        out = []
        for t in sub.targets:
            out += t.elts if isinstance(t, ast.Tuple) else [t]
        return out
    if isinstance(sub, (ast.AugAssign, ast.AnnAssign)):
        return [sub.target]
    return []


def measure(src: str, cls: str) -> dict:
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            break
    else:
        raise SystemExit(f"no class {cls}")
    mutable: set[str] = set()
    branches, long = 0, []
    for fn in (n for n in node.body if isinstance(n, ast.FunctionDef)):
        if fn.end_lineno - fn.lineno + 1 > 40:
            long.append(f"{fn.name} ({fn.end_lineno - fn.lineno + 1})")
        for sub in ast.walk(fn):
            if isinstance(sub, (ast.If, ast.For, ast.While, ast.IfExp, ast.ExceptHandler, ast.match_case)):
                branches += 1
            elif isinstance(sub, ast.BoolOp):
                branches += len(sub.values) - 1
            for t in targets_of(sub):
                name = self_attr(t)
                if name is not None and (fn.name != "__init__" or not isinstance(t, ast.Attribute)
                                         or isinstance(sub, ast.AugAssign)):
                    mutable.add(name)
            if fn.name != "__init__" and isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) \
                    and sub.func.attr in MUTATORS:
                name = self_attr(sub.func.value)
                if name is not None:
                    mutable.add(name)
    return {"mutable fields": sorted(mutable), "branch points": branches, "long functions": long}


def source(rev: str, path: str) -> str:
    if rev == "tree":
        with open(f"{ROOT}/{path}") as f:
            return f.read()
    return subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True, cwd=ROOT,
                          check=True).stdout


def main(revs: list[str]) -> None:
    for rev in revs or ["HEAD", "tree"]:
        for path, cls in TARGETS:
            m = measure(source(rev, path), cls)
            print(f"{rev:>10} {cls:16} {len(m['mutable fields']):2} mutable fields {m['mutable fields']}, "
                  f"{m['branch points']} branch points, over 40 lines: {m['long functions'] or 'none'}")


if __name__ == "__main__":
    main(sys.argv[1:])
