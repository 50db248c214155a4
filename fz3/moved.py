"""Import paths that moved when the folders were put in reading order (issue #26), still working.

    import fz3.shell.checkpoint        # the module fz3.io.checkpoint, the same object
    from fz3.core.state import Txn     # fz3.core.param.state's Txn

`fz3/__init__.py` installs `MovedFinder` on `sys.meta_path`: an old name imports the module at
its new place and is bound to it in sys.modules, so both names give one module (one set of
classes, one registry; monkeypatching either patches both; pickles made under the old names
load). New code imports the new names; tests/test_moved_paths.py checks every row.

The parity fixtures that moved to tests/support/ are not here: they were this repository's
own fixtures, and they do not ship with fz3.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util

MOVED = {
    "fz3.core.state": "fz3.core.param.state",
    "fz3.core.fetch": "fz3.core.param.fetch",
    "fz3.core.release": "fz3.core.param.release",
    "fz3.core.backward": "fz3.core.param.backward",
    "fz3.core.step": "fz3.core.param.step",
    "fz3.core.hold": "fz3.core.param.hold",
    "fz3.core.trace": "fz3.core.param.trace",
    "fz3.core.invariants": "fz3.core.param.invariants",
    "fz3.core.grads": "fz3.core.grad.grads",
    "fz3.core.epilogue": "fz3.core.grad.epilogue",
    "fz3.core.invariants_grad": "fz3.core.grad.invariants",
    "fz3.shell.checkpoint": "fz3.io.checkpoint",
    "fz3.shell.checkpoint_load": "fz3.io.checkpoint_load",
    "fz3.shell.weights": "fz3.io.weights",
    "fz3.shell.consolidate": "fz3.io.consolidate",
    "fz3.shell.init": "fz3.build.init",
    "fz3.shell.meta": "fz3.build.meta",
    "fz3.shell.plan": "fz3.observe.plan",
    "fz3.shell.fake": "fz3.observe.fake",
    "fz3.shell.guesses": "fz3.observe.guesses",
    "fz3.shell.timeline": "fz3.observe.timeline",
    "fz3.shell.timeline_draw": "fz3.observe.timeline_draw",
    "fz3.shell.api": "fz3.api",
}
"""old module name -> where it lives now"""


class MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old name of MOVED and loads it as the module at its new name."""

    def find_spec(self, name, path=None, target=None):
        if name in MOVED:
            return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec):
        return importlib.import_module(MOVED[spec.name])  # keeps its own __name__ and __spec__

    def exec_module(self, module) -> None:
        pass  # already executed under its new name


def install() -> None:
    import sys
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedFinder())
