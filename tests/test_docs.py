"""The docs' code references hold: every `path:line name` in docs/*.md names a line of that file
that defines or mentions `name` (a function, class, field or constant), and every bare
`path:line` is a line of an existing file. Refactors move lines; this test says which
references went stale (fix them with `python tests/test_docs.py --fix`)."""
from __future__ import annotations

import glob
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REF = re.compile(r"`((?:fz3|bench|examples|tests|property_tests)/[\w/.]+\.py):(\d+)(?: (\w+))?`")


def defines(line: str, name: str) -> bool:
    return re.search(rf"\b(def|class)\s+{name}\b|^\s*{name}\s*[:=]|\b{name}\b", line) is not None


def where(lines: list[str], name: str) -> int | None:
    """1-based line of the definition of `name`, else of its first mention."""
    for pattern in (rf"^\s*(async\s+)?(def|class)\s+{name}\b", rf"^\s*{name}\s*[:=]", rf"\b{name}\b"):
        for i, line in enumerate(lines):
            if re.search(pattern, line):
                return i + 1
    return None


def refs():
    for doc in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        with open(doc) as f:
            text = f.read()
        for m in REF.finditer(text):
            yield doc, m


def read_lines(path: str) -> list[str] | None:
    full = os.path.join(ROOT, path)
    if not os.path.isfile(full):
        return None
    with open(full) as f:
        return f.read().splitlines()


def test_every_code_reference_in_the_docs_holds():
    stale = []
    for doc, m in refs():
        path, line, name = m.group(1), int(m.group(2)), m.group(3)
        lines = read_lines(path)
        if lines is None:
            stale.append(f"{os.path.basename(doc)}: {m.group(0)}: no such file")
        elif not 1 <= line <= len(lines):
            stale.append(f"{os.path.basename(doc)}: {m.group(0)}: {path} has {len(lines)} lines")
        elif name and not defines(lines[line - 1], name):
            stale.append(f"{os.path.basename(doc)}: {m.group(0)}: line {line} is {lines[line - 1].strip()!r}; "
                         f"{name} is at line {where(lines, name)}")
    assert not stale, "stale references in docs/ (python tests/test_docs.py --fix):\n" + "\n".join(stale)


def fix() -> None:
    """Point every named reference at its definition (or first mention)."""
    for doc in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        with open(doc) as f:
            text = f.read()

        def repl(m):
            path, line, name = m.group(1), int(m.group(2)), m.group(3)
            lines = read_lines(path)
            if not name or lines is None or (1 <= line <= len(lines) and defines(lines[line - 1], name)):
                return m.group(0)
            found = where(lines, name)
            return m.group(0) if found is None else f"`{path}:{found} {name}`"
        with open(doc, "w") as f:
            f.write(REF.sub(repl, text))


if __name__ == "__main__" and sys.argv[1:] == ["--fix"]:
    fix()
