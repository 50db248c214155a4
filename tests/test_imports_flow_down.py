"""fz3's imports flow one way, down the layers, and never in a cycle.

    config         Config, Options, the DeepSpeed key tables: pure, imports nothing of fz3's
    core           the control plane (pure; tests/test_core_is_pure.py)
    data           tensors: layouts, collectives, the pool, the tensor store
    interpreters   run the core's effects on the data plane
    shell          torch's hooks: events in, effects out
    features       library features on the shell's engine: io/ (checkpoints, weights,
                   consolidation), build/ (Init, meta models), observe/ (plan, timeline), checking/ (fz3.check)
    the rest       what is built on all of it: fz3.api (initialize), fz3.deepspeed, fz3.hf,
                   fz3.func, the launcher, the CLI, fz3.testing

Every import in every file under fz3/ is read, those inside functions too (a lazy import is
still an arrow), and held against that order; an import under `if TYPE_CHECKING:` is not (it
names a type for annotations and never runs: fz3/core/calls.py names the event records that
events.py, which imports it, defines). fz3/__init__.py loads the shell's names on first
use by name (importlib), which no arrow here sees: it is the top.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import fz3

ROOT = Path(fz3.__file__).parent
LAYERS = ("config", "core", "data", "interpreters", "shell", "features")  # bottom first; anything else is above
FEATURES = ("io", "build", "observe", "checking")  # one layer: they may use each other, never in a cycle


def layer(module: str) -> int:
    parts = module.split(".")
    top = "features" if len(parts) > 1 and parts[1] in FEATURES else parts[1] if len(parts) > 1 else ""
    return LAYERS.index(top) if top in LAYERS else len(LAYERS)


def modules(root: Path = ROOT) -> dict[str, str]:
    """Module name -> its source, for every file of the package."""
    out = {}
    for f in sorted(root.rglob("*.py")):
        name = ".".join(("fz3",) + f.relative_to(root).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = f.read_text()
    return out


def _typing_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:`: names for annotations, never run."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return out


def imports(sources: dict[str, str]) -> dict[str, set[str]]:
    """Module -> the modules of the package it imports (anywhere in the file, but for the names
    an `if TYPE_CHECKING:` block imports for annotations: they never run)."""
    out: dict[str, set[str]] = {}
    for name, source in sources.items():
        found = set()
        tree = ast.parse(source)
        typing_only = _typing_only(tree)
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        out[name] = {m for m in found if m in sources and m != name}
    return out


def arrows_up(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} -> {b} ({LAYERS[layer(a)]} imports {LAYERS[layer(b)] if layer(b) < len(LAYERS) else b})"
                  for a, bs in graph.items() for b in bs if layer(b) > layer(a))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while comp[-1:] != [v]:
                comp.append(stack.pop())
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_there_are_imports_to_check():
    graph = imports(modules())
    assert "fz3.core.param.fetch" in graph["fz3.core.calls"]
    assert "fz3.data.store" in graph["fz3.interpreters.dist"]
    assert sum(len(bs) for bs in graph.values()) > 300


def test_no_import_runs_up_a_layer():
    assert arrows_up(imports(modules())) == []


def test_no_modules_import_each_other():
    assert cycles(imports(modules())) == []


def test_the_check_sees_an_arrow_up_and_a_cycle():
    planted = {"fz3.core.param.fetch": "from fz3.core.param.release import release\n",
               "fz3.core.param.release": "def f():\n    from fz3.shell.engine import Engine\n    import fz3.core.param.fetch\n",
               "fz3.shell.engine": "import torch\n"}
    graph = imports(planted)
    assert arrows_up(graph) == ["fz3.core.param.release -> fz3.shell.engine (core imports shell)"]
    assert cycles(graph) == [["fz3.core.param.fetch", "fz3.core.param.release"]]


ALONE = """
import importlib, importlib.abc, sys, types
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "numpy"):
            raise ImportError(f"fz3.config imported {name}")
sys.meta_path.insert(0, Refuse())
import fz3.config, fz3.config.config, fz3.config.options, fz3.config.deepspeed_keys
fz3.config.Config.from_deepspeed({"zero_optimization": {"stage": 3}})
print(sorted(m for m in sys.modules if m.startswith("fz3")))
"""


def test_the_config_imports_alone():
    """`import fz3` loads the config and nothing else of fz3's; the config loads no torch."""
    out = subprocess.run([sys.executable, "-c", ALONE], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str(["fz3", "fz3.config", "fz3.config.config", "fz3.config.deepspeed_keys",
                                      "fz3.config.offload", "fz3.config.options"])


def test_a_feature_is_above_the_shell():
    """The shell's engine may not call a library feature (fz3/io/engine_methods.py holds the
    engine methods that do); features may use each other."""
    planted = {"fz3.shell.engine": "from fz3.io.checkpoint import save_checkpoint\n",
               "fz3.io.checkpoint": "import fz3.build.init\n", "fz3.build.init": "import fz3.shell.engine\n"}
    graph = imports(planted)
    assert arrows_up(graph) == ["fz3.shell.engine -> fz3.io.checkpoint (shell imports features)"]
