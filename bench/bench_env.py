"""What the bench scripts share around their runs: the peers' environment, and their own section
of bench/RESULTS.md.

    ensure_env(__file__)                           # re-run the script under bench/.env
    replace_section(path, section, begin, end)     # its section, the rest of the file kept
    write_section(path, key, title, body)         # the same between <!-- key:begin/end --> markers
    commit()                                       # fz3's short commit, for a figure's line
"""
from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ENV_PY = os.path.join(HERE, ".env", "bin", "python")


def ensure_env(script: str) -> None:
    """Re-run `script` under bench/.env (created by setup_env.sh when missing), unless already."""
    if os.path.realpath(sys.prefix) == os.path.realpath(os.path.join(HERE, ".env")):
        return
    subprocess.run(["bash", os.path.join(HERE, "setup_env.sh")], check=True)
    os.execv(ENV_PY, [ENV_PY, "-W", "ignore::FutureWarning", os.path.abspath(script), *sys.argv[1:]])


def replace_section(path: str, section: str, begin: str, end: str) -> None:
    """Put `section` (which starts with `begin` and ends with `end`) in place of the text between
    those markers, or at the end of the file if they are absent."""
    old = open(path).read() if os.path.exists(path) else "# fz3 benchmark results\n"
    if begin in old and end in old:
        new = old[:old.index(begin)] + section + old[old.index(end) + len(end):]
    else:
        new = old.rstrip("\n") + "\n\n" + section + "\n"
    with open(path, "w") as f:
        f.write(new)


def write_section(path: str, key: str, title: str, body: str) -> None:
    """Print `body` and, unless `path` is empty, make it RESULTS.md's section `key` (between the
    markers <!-- key:begin --> and <!-- key:end -->) under the heading `title`."""
    print(body)
    if path:
        begin, end = f"<!-- {key}:begin -->", f"<!-- {key}:end -->"
        replace_section(path, f"{begin}\n## {title}\n\n{body}{end}", begin, end)


def commit() -> str:
    """fz3's short commit (HEAD of this checkout), as each figure's line names it."""
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=HERE).stdout.strip()
