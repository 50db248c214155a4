"""Run fz3's machines on your replacement of one of its functions, without editing fz3.

    with patched("fz3.core.param.release:release_into", my_release_into) as p:
        run_state_machine_as_test(ParamLifecycleMachine)   # the machine runs on your core
    print(p)   # patched fz3.core.param.release.release_into (also bound in fz3.core.param.backward)

    python -m fz3 verify --patch fz3.core.param.release:release_into=mypkg.bugs:my_release_into

[Note: every binding] fz3's modules import functions by name (`from fz3.core.param.fetch import
fetch_into` in fz3/core/param/backward.py), so a function is reachable under its name in every
module that imported it, each binding a separate global. Rebinding the defining module's name
(pytest's `monkeypatch.setattr(fetch, "fetch_into", f)`) changes only that one: backward.py's
`fetch_for_backward` still calls the original, and the machine tests a core that is half yours.
`patched` finds every attribute of every loaded fz3 module that *is* the original function
object and rebinds each; on leaving, it puts each back, and also any binding of the replacement
made by a module first imported while the patch was on. The replacement's own module is left
alone, so a replacement may call the original through its own import of it
(`from fz3.core.param.release import release_into`). What is not a module attribute (a function
held in a closure, a default argument or a table built at import) is not rebound: fz3's core
keeps none.

Errors (PatchError, a ValueError) say what was passed, the offending value and what is allowed.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import os
import reprlib
import sys
from dataclasses import dataclass
from types import FunctionType, ModuleType
from typing import Callable, Iterator, Sequence

EXAMPLE = "fz3.core.param.release:release_into=mypkg.bugs:my_release_into"


class PatchError(ValueError):
    """A patch that cannot be made: what was passed, the offending value, what is allowed."""


@dataclass(frozen=True)
class Patch:
    """One patch in force: the original's qualified name and every module that bound it."""

    name: str  # e.g. fz3.core.param.release.release_into
    modules: tuple[str, ...]  # where it was rebound, its defining module first

    def __str__(self) -> str:
        others = [m for m in self.modules if m != self.name.rpartition(".")[0]]
        return f"patched {self.name}" + (f" (also bound in {', '.join(others)})" if others else "")


_ACTIVE: dict[int, str] = {}  # id(replacement) -> the name it replaces, while a patch is on


@contextlib.contextmanager
def patched(target: str, replacement: Callable | str) -> Iterator[Patch]:
    """Replace fz3's function `target` ("module:function", e.g. "fz3.core.param.release:release")
    by `replacement` (a callable, or "module:function" / "file.py:function" to import) in every
    loaded fz3 module that binds it ([Note: every binding]); all put back on leaving, even on an
    error. Yields the Patch (str() says where it patched)."""
    original = resolve(target)
    new = load(replacement, what=f"the replacement for {target}") if isinstance(replacement, str) else replacement
    if not callable(new):
        shown = replacement if isinstance(replacement, str) else reprlib.repr(new)
        raise PatchError(f"the replacement for {target}, {shown!r}, is a {type(new).__name__}, not callable: "
                         "give a function that takes what the original takes")
    if id(new) in _ACTIVE:
        raise PatchError(f"the replacement for {target}, {new!r}, already replaces {_ACTIVE[id(new)]}; "
                         "give each patch its own function")
    check_signature(original, new, target)
    home = getattr(new, "__module__", None)
    before = set(sys.modules)
    rebound = [(m, n) for m, n in bindings(original) if m.__name__ != home]
    for m, n in rebound:
        setattr(m, n, new)
    _ACTIVE[id(new)] = qualified(original)
    try:
        yield Patch(qualified(original), _order(original, [m.__name__ for m, _ in rebound]))
    finally:
        del _ACTIVE[id(new)]
        for m, n in rebound:
            setattr(m, n, original)
        for m, n in bindings(new, only=set(sys.modules) - before):  # imported while patched
            setattr(m, n, original)


@contextlib.contextmanager
def patched_all(specs: Sequence[str]) -> Iterator[list[Patch]]:
    """Several "module:function=replacement" patches (verify's --patch flags), all in force
    together; refused if two name the same function."""
    pairs = [parse(s) for s in specs]
    seen: dict[str, str] = {}
    for spec, (target, _) in zip(specs, pairs):
        name = qualified(resolve(target))
        if name in seen:
            raise PatchError(f"--patch {spec!r}: {name} is already patched by --patch {seen[name]!r}; "
                             "patch each function once")
        seen[name] = spec
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(patched(target, replacement)) for target, replacement in pairs]


def parse(spec: str) -> tuple[str, str]:
    """ "module:function=replacement" -> (target, replacement)."""
    target, eq, replacement = spec.partition("=")
    if not eq or ":" not in target or ":" not in replacement or not target.strip() or not replacement.strip():
        raise PatchError(f"--patch {spec!r} is not MODULE:FUNCTION=MODULE:FUNCTION (the function of fz3, then "
                         f"your replacement; e.g. --patch {EXAMPLE})")
    return target.strip(), replacement.strip()


def resolve(target: str) -> FunctionType:
    """The function of fz3 named "module:function"."""
    module_name, sep, name = target.partition(":")
    if not sep or not module_name or not name:
        raise PatchError(f"{target!r} is not MODULE:FUNCTION naming a function of fz3 "
                         "(e.g. fz3.core.param.release:release)")
    if module_name != "fz3" and not module_name.startswith("fz3."):
        raise PatchError(f"{target!r}: {module_name!r} is not a module of fz3; a patch replaces a function "
                         "of fz3 (e.g. fz3.core.param.release:release)")
    module = _import(module_name, f"{target!r}")
    if not hasattr(module, name):
        functions = sorted(k for k, v in vars(module).items()
                           if isinstance(v, FunctionType) and _of_fz3(v) and not k.startswith("__"))
        raise PatchError(f"{target!r}: {module_name} has no function {name!r}; its functions: "
                         f"{', '.join(functions) or 'none'}")
    fn = getattr(module, name)
    if id(fn) in _ACTIVE:
        raise PatchError(f"{target!r}: {_ACTIVE[id(fn)]} is already patched; patch each function once")
    if not isinstance(fn, FunctionType):
        raise PatchError(f"{target!r}: {module_name}.{name} is a {type(fn).__name__}, not a function; a patch "
                         "replaces a function (a transition, or a helper it calls)")
    if not _of_fz3(fn):
        raise PatchError(f"{target!r}: {module_name}.{name} is {qualified(fn)}, a function of another package "
                         "imported into fz3; a patch replaces a function of fz3")
    return fn


def load(ref: str, *, what: str) -> object:
    """The object named by "module:attr" or "path/to/file.py:attr", imported."""
    module_name, sep, name = ref.rpartition(":")
    if not sep or not module_name or not name:
        raise PatchError(f"{what}: {ref!r} is not MODULE:FUNCTION (e.g. mypkg.bugs:my_release or bugs.py:my_release)")
    if module_name.endswith(".py"):
        if not os.path.isfile(module_name):
            raise PatchError(f"{what}: {module_name!r}: no such file")
        spec = importlib.util.spec_from_file_location(os.path.basename(module_name)[:-3], module_name)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            raise PatchError(f"{what}: cannot import {module_name!r}: {type(e).__name__}: {e}") from None
    else:
        module = _import(module_name, f"{what}: {ref!r}")
    if not hasattr(module, name):
        raise PatchError(f"{what}: {module_name!r} has no attribute {name!r}")
    return getattr(module, name)


def check_signature(original: FunctionType, new: Callable, target: str) -> None:
    """`new` accepts every call the original accepts: its required arguments as they are
    passed, and each optional one by keyword. Refused before the run, not as a TypeError deep in
    a machine's step."""
    try:
        theirs = inspect.signature(new)
    except (TypeError, ValueError):
        return  # a builtin or a callable without a signature: trust it
    args, kwargs = [], {}
    for p in inspect.signature(original).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or (p.kind is p.POSITIONAL_ONLY and p.default is not p.empty):
            continue
        if p.default is p.empty and p.kind is not p.KEYWORD_ONLY:
            args.append(None)
        else:
            kwargs[p.name] = None
    try:
        theirs.bind(*args, **kwargs)
    except TypeError as e:
        raise PatchError(f"the replacement for {target} takes {_bare(theirs)}, but fz3 calls "
                         f"{qualified(original)}{_bare(inspect.signature(original))}: it must accept every "
                         f"argument the original does ({e})") from None


def _bare(sig: inspect.Signature) -> inspect.Signature:
    """`sig` without its annotations, as a reader compares two."""
    return sig.replace(parameters=[p.replace(annotation=p.empty) for p in sig.parameters.values()],
                       return_annotation=sig.empty)


def bindings(fn: object, *, only: set[str] | None = None) -> list[tuple[ModuleType, str]]:
    """(module, attribute) of every loaded fz3 module (or of those in `only`) bound to `fn`."""
    out = []
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "fz3" or name.startswith("fz3.")) or (only is not None and name not in only):
            continue
        out += [(module, k) for k, v in list(vars(module).items()) if v is fn]
    return out


def qualified(fn: Callable) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


def _order(fn: FunctionType, modules: list[str]) -> tuple[str, ...]:
    """The modules, the defining one first, the rest sorted."""
    return tuple(sorted(set(modules), key=lambda m: (m != fn.__module__, m)))


def _of_fz3(fn: FunctionType) -> bool:
    return fn.__module__ == "fz3" or fn.__module__.startswith("fz3.")


def _import(module_name: str, what: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except Exception as e:  # the module failed to import: say which and why
        raise PatchError(f"{what}: cannot import {module_name!r}: {type(e).__name__}: {e}") from None
