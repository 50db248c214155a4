"""Reusable test machinery: the Hypothesis state machines (param_machine, calls_machine,
grad_machine), the naive models they are checked against, the simulated autograd
(autograd_sim), the shadow of a real run (shadow) and `verify` (python -m fz3 verify).
`gpt` is a small GPT for examples and benchmarks; it needs torch only.

The machines need the test extra (`pip install 'fz3[test]'`: Hypothesis). Without it, importing
one of them fails with an error that says so, not a bare "No module named 'hypothesis'".
"""
import importlib.abc
import importlib.util
import sys


class _NeedsTestExtra(importlib.abc.MetaPathFinder):
    """Installed only when Hypothesis is missing: a machine's import of it fails naming the
    extra. Anybody else who asks (torch._dynamo probes `find_spec("hypothesis")` for its skip
    list) is told it is not there, as without this finder."""

    def find_spec(self, name, path=None, target=None):
        if (name == "hypothesis" or name.startswith("hypothesis.")) and _imported_by_fz3_testing():
            raise ModuleNotFoundError(
                "fz3.testing's machines need Hypothesis, which is not installed: "
                "pip install 'fz3[test]' (or pip install hypothesis)", name="hypothesis")
        return None


def _imported_by_fz3_testing() -> bool:
    """Whether the import being resolved is a statement in a module of fz3.testing: the first
    frame outside importlib's machinery (and this file) belongs to one."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith("<frozen importlib")
                                 or frame.f_code.co_filename == __file__
                                 or frame.f_globals.get("__name__", "").startswith("importlib")):
        frame = frame.f_back
    return frame is not None and frame.f_globals.get("__name__", "").startswith("fz3.testing.")


def _has_hypothesis() -> bool:
    try:
        return importlib.util.find_spec("hypothesis") is not None
    except ImportError:
        return False


if not _has_hypothesis() and not any(isinstance(f, _NeedsTestExtra) for f in sys.meta_path):
    sys.meta_path.insert(0, _NeedsTestExtra())
