"""Fake tensors for fz3.plan: the model runs on shapes alone; what it reads of its data is known
where it can be, guessed where it cannot, and every guess of the model's is recorded.

    fakes = Fakes(model)                  # fakes.model: a copy with fake params and buffers
    with fakes:                           # PlanFakeMode: FakeTensorMode, known values, guesses
        args, kwargs = fakes.inputs(args, kwargs)
        engine(*args, **kwargs)           # every tensor made inside is fake: no memory
    fakes.guesses()                       # [Guess, ...]: what the model read that was guessed

One op in PlanFakeMode.dispatch:

    FakeTensorMode's dispatch ---- every tensor input's value known, output small: computed
      |                            for real, its value known (the fake's `constant`); else
      |                            shapes only (meta kernels)
      +-- a factory (arange, ones, full) in the model's code, output small: computed for real,
      |   its value known
      +-- raises: the value (.item(), `if t:`) or the output's shape (nonzero, x[mask], unique)
          depends on data it does not have
            |
            v
          a guess (fz3/observe/guesses.py), recorded: a bool is True, an integer 1, a float
          1.0, a mask all True, elements all distinct

[Note: why fake tensors] A meta tensor has no device of its own: a tensor the forward makes
without one (`torch.arange(T)`) is a real cpu tensor, and mixing it with meta params fails.
A fake tensor (torch._subclasses.fake_tensor) has a device, cpu here, what fz3.initialize trains
on without an accelerator, over meta storage: no memory, and everything made inside the mode is
fake too. Hugging Face's mask code asks `is_fake_tensor` and skips its data-dependent shortcuts.

[Note: known values] FakeTensorMode keeps the value of a tensor whose every input's value is
known (`FakeTensor.constant`), dropping it when something unknown writes to it or to an alias.
Torch keeps one element; here up to KNOWN_NUMEL, and the example inputs, the model's buffers and
its factories start known. So a mask or a position made from the inputs is read exactly, and a
guess is needed only for a value that comes from the params (a router's choice, a NaN check).
What a guessed op returns is known where it can be (nonzero of an all-True mask: its indices),
so what the model reads from it afterwards is exact under the guess. The params, and every
tensor fz3's own code makes from nothing (shards, gathered values, grad buffers), are never
known: no param value is ever computed.

[Note: whose guess] A guess is the model's when the innermost frame that is neither torch's nor
the standard library's is not fz3's (fz3/testing's models count as a model's), or during
backward, where torch's own formulas run under fz3's engine.backward. fz3's own (the grad norm
in engine.step) are answered and not reported: the plan's figures do not depend on them.
"""
from __future__ import annotations

import contextlib
import copy
import itertools
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException, FakeTensor,
                                           FakeTensorMode, unset_fake_temporarily)
from torch.utils import _pytree

from fz3.shell import compiled, tables
from fz3.observe.guesses import FINITE, GUESSES, STRICTER_META, scalar_rule

KNOWN_NUMEL = 1 << 20
"""Largest tensor (elements) whose value a plan computes: masks and positions of a micro-batch."""
UNINITIALIZED = ("empty", "new_empty", "empty_strided", "empty_like", "new_empty_strided")
"""Factories whose value is not defined: never known."""

TORCH = os.path.dirname(torch.__file__) + os.sep
FZ3 = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
MODELS = os.path.join(FZ3, "testing") + os.sep  # fz3's test models are models
STDLIB = os.path.dirname(os.__file__) + os.sep
OURS = (__file__, os.path.join(os.path.dirname(__file__), "guesses.py"))  # frames that are the plan's


@dataclass(frozen=True)
class Guess:
    """A data-dependent value the model read that the plan could not know, and what it took."""
    op: str  # the torch op, e.g. aten._local_scalar_dense (.item(), `if t:`) or aten.nonzero
    value: str  # what was guessed, e.g. True, 1, every element nonzero
    where: str  # file:line of the model's code that read it (backward: "backward")
    modules: tuple[str, ...]  # the model's modules running then, by qualified name ("" = root)
    times: int  # how many times, over every planned micro-step

    def __str__(self) -> str:
        mods = ", ".join(m or "(root)" for m in self.modules[:2])
        more = f" +{len(self.modules) - 2} more" if len(self.modules) > 2 else ""
        site = f"at {self.where} in {mods}{more}" if mods else f"at {self.where}"
        return f"{self.op} -> {self.value}, {self.times}x {'during backward' if self.where == 'backward' else site}"


class Fakes:
    """The fake mode, the model's fake copy and the guesses made while they run."""

    def __init__(self, model: nn.Module) -> None:
        self.mode = PlanFakeMode()
        self.model = self._copy(model)
        self.mode.names = {id(m): n for n, m in self.model.named_modules()}

    def __enter__(self) -> "Fakes":
        self.mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.mode.__exit__(*exc)

    def known(self, t: torch.Tensor) -> torch.Tensor:
        """A fake of `t` that keeps its value when it is small, or only its shape; `t` is not
        touched (its value is copied). A fake already is one."""
        if isinstance(t, FakeTensor):
            return t
        if t.is_meta or t.numel() > KNOWN_NUMEL:
            with self.mode:
                return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
        with unset_fake_temporarily():
            real = t.detach().to("cpu", copy=True)
        return self.mode.fake_tensor_converter.from_real_tensor(self.mode, real, make_constant=True)

    def inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The example inputs as fakes that keep their values ([Note: known values])."""
        def fake(x: torch.Tensor) -> torch.Tensor:
            f = self.known(x)
            return f.requires_grad_() if x.requires_grad else f
        return _pytree.tree_map_only(torch.Tensor, fake, (args, kwargs))

    def guesses(self) -> list[Guess]:
        return self.mode.guesses()

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        """Guesses inside are the model's, whichever frame runs them ([Note: whose guess])."""
        self.mode.in_backward = True
        try:
            yield
        finally:
            self.mode.in_backward = False

    def _copy(self, model: nn.Module) -> nn.Module:
        """`model` with every param a fake of the same shape, dtype and requires_grad (its value
        never known), every buffer and tensor attribute a known fake; ties stay ties."""
        memo: dict[int, object] = {}
        for t in itertools.chain(model.parameters(), model.buffers()):
            if id(t) in memo:
                continue
            if isinstance(t, nn.Parameter):
                with self.mode:
                    memo[id(t)] = nn.Parameter(torch.empty(t.shape, dtype=t.dtype, device="cpu"),
                                               requires_grad=t.requires_grad)
            else:
                memo[id(t)] = self.known(t)
        for m in model.modules():
            for v in vars(m).values():
                if isinstance(v, torch.Tensor) and id(v) not in memo:
                    memo[id(v)] = self.known(v)
        return _same_units(model, copy.deepcopy(model, memo))


class PlanFakeMode(FakeTensorMode):
    """FakeTensorMode that keeps values of up to KNOWN_NUMEL elements, makes the model's small
    factories known, and answers with a recorded guess where FakeTensorMode has none. One mode,
    not a second one stacked on it: a 7B plan dispatches ~10^5 ops, and each layer costs."""

    known_numel = KNOWN_NUMEL  # what the guesses (fz3/observe/guesses.py) may compute for real

    def __init__(self) -> None:
        super().__init__(allow_non_fake_inputs=True)
        self.names: dict[int, str] = {}  # id(module) -> qualified name, in the fake copy
        self.in_backward = False  # set by fz3.plan around loss.backward ([Note: whose guess])
        self.seen: dict[tuple[str, str, str], tuple[list[str], list[int]]] = {}
        self.own = 0  # fz3's own guesses, answered and not reported

    def may_turn_const(self, t: torch.Tensor) -> bool:
        return (t.numel() <= KNOWN_NUMEL and t.layout == torch.strided and not self.is_our_fake(t)
                and t.device.type != "meta")

    def dispatch(self, func, types, args=(), kwargs=None):
        """FakeTensorMode's, then a known factory or a guess (the module doc's diagram). Runs
        with the mode unset, as FakeTensorMode's own: a fake's method re-enters it."""
        kwargs = kwargs or {}
        if func in STRICTER_META:
            return STRICTER_META[func](func, args, kwargs)
        if func.overloadpacket in FINITE and _unknown(args[0]):
            return self._finite(func, args[0])
        try:
            out = super().dispatch(func, types, args, kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            rule = GUESSES.get(func.overloadpacket) or scalar_rule(func)
            if rule is None:
                raise RuntimeError(f"fz3.plan: {func} depends on the data (its value or its output's "
                                   f"shape) and the plan has no guess for it; {self._site_text()}") from None
            out, value = rule(self, func, args, kwargs)
            self._record(func, value)
            return out
        if _is_factory(func, args, kwargs, out) and not _site()[0]:
            with unset_fake_temporarily():
                real = func(*args, **kwargs)
            return self.known(real, out)
        return out

    def _finite(self, func, t: torch.Tensor) -> torch.Tensor:
        """isnan, isinf, isfinite of a value the plan does not have: every element finite, so a
        model's NaN check passes as it would on ordinary data (a guess, recorded)."""
        self._record(func, "every element finite")
        with unset_fake_temporarily():
            real = torch.full(t.shape if t.numel() <= KNOWN_NUMEL else (0,), FINITE[func.overloadpacket])
        return self.known(real, t) if t.numel() <= KNOWN_NUMEL else t.new_empty(t.shape, dtype=torch.bool)

    def known(self, real: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """A fake of the real `real` on `like`'s device, its value known when small."""
        if real.numel() > KNOWN_NUMEL:
            return like.new_empty(real.shape, dtype=real.dtype)
        return self.fake_tensor_converter.from_real_tensor(self, real, make_constant=True)

    def _record(self, func, value: str) -> None:
        own, where, module = _site(self.names)
        if own and not self.in_backward:
            self.own += 1
            return
        key = (str(func), value, "backward" if own else where)
        modules, times = self.seen.setdefault(key, ([], [0]))
        if module is not None and module not in modules:
            modules.append(module)
        times[0] += 1

    def _site_text(self) -> str:
        _, where, module = _site(self.names)
        return f"at {where}" + (f" in module {module or '(root)'!r}" if module is not None else "")

    def guesses(self) -> list[Guess]:
        return [Guess(op, value, where, tuple(mods), times[0])
                for (op, value, where), (mods, times) in self.seen.items()]


def _unknown(t) -> bool:
    return isinstance(t, FakeTensor) and t.constant is None


def _is_factory(func, args, kwargs, out) -> bool:
    """A small tensor made from no tensor, deterministic, on cpu: its value can be computed."""
    if not isinstance(out, torch.Tensor) or any(isinstance(a, torch.Tensor) for a in args):
        return False  # most ops: a tensor in, or not a tensor out
    return (out.device.type == "cpu" and out.numel() <= KNOWN_NUMEL and isinstance(func, torch._ops.OpOverload)
            and torch.Tag.nondeterministic_seeded not in func.tags and func.overloadpacket.__name__ not in UNINITIALIZED
            and not any(isinstance(x, torch.Tensor) for x in _pytree.tree_leaves((args, kwargs))))


def _site(names: dict[int, str] | None = None) -> tuple[bool, str, str | None]:
    """(fz3's own?, file:line, running module's name) of the op being dispatched: the innermost
    frame that is not torch's or the standard library's, and the innermost module whose method
    is on the stack ([Note: whose guess])."""
    frame, where, own = sys._getframe(1), None, False
    while frame is not None and where is None:
        path = frame.f_code.co_filename
        if not (path.startswith(TORCH) or path in OURS or (path.startswith(STDLIB) and "-packages" not in path)):
            own = path.startswith(FZ3) and not path.startswith(MODELS)
            where = f"{_short(path)}:{frame.f_lineno}"
        frame = frame.f_back
    module = None
    if names is not None:
        frame = sys._getframe(1)
        while frame is not None and module is None:
            module = names.get(id(frame.f_locals.get("self")))
            frame = frame.f_back
    return own, where or "?", module


def _short(path: str) -> str:
    for mark in ("site-packages" + os.sep, "dist-packages" + os.sep):
        if mark in path:
            return path.split(mark, 1)[1]
    return os.path.relpath(path) if path.startswith(os.getcwd()) else path


def _same_units(model: nn.Module, dup: nn.Module) -> nn.Module:
    """The copy with the fetch units the model has: leaf marks and compiled regions do not
    survive a deepcopy (the marks are by object; torch drops `_compiled_call_impl` and rebuilds
    a torch.compile wrapper around the copy). The copy compiles nothing: a region is marked, a
    wrapper becomes a plain one around the same block ([Note: compiled regions], compiled.py)."""
    for orig, new in zip(model.modules(), dup.modules()):
        if tables.marked_leaf(orig):
            tables.mark_leaves([new])
        if compiled.compiled_in_place(orig):
            compiled.mark_region(new)
    for parent in dup.modules():
        for name, child in parent.named_children():
            if compiled.is_wrapper(child) and not isinstance(child, compiled.PlannedWrapper):
                parent._modules[name] = compiled.PlannedWrapper(child._orig_mod)
    if compiled.is_wrapper(dup) and not isinstance(dup, compiled.PlannedWrapper):
        dup = compiled.PlannedWrapper(dup._orig_mod)
    return dup
