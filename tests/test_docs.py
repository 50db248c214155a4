"""The docs' code references hold: every `path:line name` in docs/*.md and README.md names a line
of that file that defines or mentions `name` (a function, class, field or constant; `Class.field`
for a field of a class), and every bare `path:line` is a line of an existing file. docs/learn.md,
the reading path, is held to more: its `path:line name` is the line where `name` is defined
(`def name`, `class name`, `name =`, `name:` or `self.name =`), so a reader lands on the
definition, not on a use. A reference these rules cannot read (`fz3/x.py:12-20`,
`fz3/x.py:12 f()`) fails too, so none goes unchecked. Refactors move lines; this test says which references went stale (fix them
with `python tests/test_docs.py --fix`, or `--fix docs/learn.md` for one doc)."""
from __future__ import annotations

import glob
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATH = r"(?:fz3|bench|examples|tests|property_tests)/[\w/.]+\.py"
REF = re.compile(rf"`({PATH}):(\d+)(?: ([A-Za-z_]\w*(?:\.\w+)*))?`")
ANY_REF = re.compile(rf"`{PATH}:\d[^`]*`")  # whatever looks like one, readable by REF or not
STRICT = {"learn.md"}  # docs whose named references must land on the definition


def docs() -> list[str]:
    return sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))) + [os.path.join(ROOT, "README.md")]


def definition(name: str) -> tuple[str, ...]:
    """Patterns of a line that defines `name` (an attribute set in a method too: `self.name =`)."""
    return (rf"^\s*(async\s+)?(def|class)\s+{name}\b", rf"^\s*(self\.)?{name}\s*[:=]")


def defines(line: str, name: str, *, strict: bool = False) -> bool:
    """`line` defines (or, unless `strict`, mentions) `name`; for `Class.field`, the field."""
    last = name.split(".")[-1]
    patterns = definition(last) + (() if strict else (rf"\b{last}\b",))
    return any(re.search(p, line) for p in patterns)


def where(lines: list[str], name: str) -> int | None:
    """1-based line of the definition of `name`, else of its first mention; for `Class.field`,
    the first line of the body of `class Class` that defines `field`."""
    *owners, last = name.split(".")
    start, end = 0, len(lines)
    for owner in owners:  # narrow to the body of each enclosing class in turn
        found = where(lines[start:end], owner)
        if found is None:
            return None
        start, end = start + found, _body_end(lines, start + found - 1, end)
    if owners:
        inside = [i for i in range(start, end) if any(re.search(p, lines[i]) for p in definition(last))]
        return inside[0] + 1 if inside else None
    for pattern in definition(last) + (rf"\b{last}\b",):
        for i in range(start, end):
            if re.search(pattern, lines[i]):
                return i + 1
    return None


def _body_end(lines: list[str], head: int, end: int) -> int:
    """The index after the body of the block whose header is lines[head]."""
    indent = len(lines[head]) - len(lines[head].lstrip())
    for i in range(head + 1, end):
        text = lines[i]
        if text.strip() and len(text) - len(text.lstrip()) <= indent:
            return i
    return end


def refs():
    for doc in docs():
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
        strict = os.path.basename(doc) in STRICT
        lines = read_lines(path)
        if lines is None:
            stale.append(f"{os.path.basename(doc)}: {m.group(0)}: no such file")
        elif not 1 <= line <= len(lines):
            stale.append(f"{os.path.basename(doc)}: {m.group(0)}: {path} has {len(lines)} lines")
        elif name and not defines(lines[line - 1], name, strict=strict):
            stale.append(f"{os.path.basename(doc)}: {m.group(0)}: line {line} is {lines[line - 1].strip()!r}; "
                         f"{name} is {'defined ' if strict else ''}at line {where(lines, name)}")
    assert not stale, "stale references in the docs (python tests/test_docs.py --fix):\n" + "\n".join(stale)


def test_every_code_reference_in_the_docs_is_readable():
    """A reference written in another form than `path:line` or `path:line name` is not checked
    by the test above, so it is an error here."""
    unread = []
    for doc in docs():
        with open(doc) as f:
            text = f.read()
        unread += [f"{os.path.basename(doc)}: {m.group(0)}" for m in ANY_REF.finditer(text)
                   if not REF.fullmatch(m.group(0))]
    assert not unread, "references the docs test cannot read (write `path:line` or `path:line name`):\n" + \
        "\n".join(unread)


def fix(only: list[str] | None = None) -> None:
    """Point every named reference at its definition (or, outside STRICT, its first mention);
    in the docs `only` names (paths), or in all of them."""
    wanted = None if not only else {os.path.abspath(d) for d in only}
    for doc in docs():
        if wanted is not None and os.path.abspath(doc) not in wanted:
            continue
        with open(doc) as f:
            text = f.read()
        strict = os.path.basename(doc) in STRICT

        def repl(m):
            path, line, name = m.group(1), int(m.group(2)), m.group(3)
            lines = read_lines(path)
            if not name or lines is None or (
                    1 <= line <= len(lines) and defines(lines[line - 1], name, strict=strict)):
                return m.group(0)
            found = where(lines, name)
            return m.group(0) if found is None else f"`{path}:{found} {name}`"
        new = REF.sub(repl, text)
        if new != text:
            with open(doc, "w") as f:
                f.write(new)


if __name__ == "__main__" and sys.argv[1:2] == ["--fix"]:
    fix(sys.argv[2:])  # python tests/test_docs.py --fix [docs/learn.md ...]
