"""torch.compile and fz3: which modules are compiled regions, and fz3's hooks kept out of them.

    is_compiled(module)     torch.compile(block) (an OptimizedModule) or block.compile()
    outside_graph(fn)       a hook the compiler calls as a graph break, never traces into
    regions(model)          what engine.compile() compiles: the repeated blocks
    compile_engine(...)     engine.compile(): compile the regions, make them the fetch units
    compile_stats(engine)   stats()' compiler keys

[Note: compiled regions] A compiled module is one fetch unit, as a leaf module is
(fz3/shell/tables.py): its pre-forward gathers every param of its subtree, its post-forward and
the backward of its outputs release them, and no module inside it has fz3 hooks. So the code the
compiler traces reads params that are gathered for its whole run, full values with their real
shapes and strides, and calls nothing of fz3's: the graph is the block's forward, whole, and the
only graph breaks are fz3's two hooks at its edges. Without this every Linear inside a block is
a unit of its own, the compiler meets its hooks mid-graph and breaks there, and the params it
lifted as graph inputs may be 1-D shards or empty when a later piece runs (issue #25).
torch.compile(block) returns a wrapper (an OptimizedModule) whose `_orig_mod` is the block: the
block is the unit, not the wrapper, because a compiled model that holds wrappers is traced
through them to the blocks inside (dynamo unwraps them), and only the block's hooks are met.
FSDP2's recipe is the same shape: compile each transformer block before fully_shard, whose
hooks are `_dynamo_disable`d (torchtitan `distributed/compile.py`); DeepSpeed's
engine.compile() keeps its hooks out the same way (`@torch.compiler.disable`) but leaves every
module a unit, so its graphs break at every module.

[Note: hooks outside the graph] Every entry point torch calls in fz3 (forward pre/post hooks,
the param reads of ParamDict, the grad hooks, the saved-tensor pack and unpack) is disabled for
the compiler (`outside_graph`): when the compiler
meets one while tracing (a block compiled with block.compile() runs its hooks inside its
compiled `_call_impl`; torch.compile(model) traces the whole tree), it breaks the graph there and
runs the hook eagerly with the compiler off, so nothing fz3 does (gathers, pool, core) is ever
traced. The wrapper is torch.compiler.disable's without its ~1 us a call (0.3 us here; a
module visit runs two hooks): the same two marks dynamo reads
(`_torchdynamo_disable`: do not trace, break the graph; the wrapper's code skipped as a frame of
its own) and the same switch (the frame evaluation callback off while the hook runs, so nothing
it calls is compiled either). Where torch lacks these, torch.compiler.disable itself.
"""
from __future__ import annotations

import sys
import weakref
from typing import Callable, TypeVar

import torch
from torch import nn

try:
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy, set_eval_frame
except ImportError:  # a torch without these: torch.compiler.disable instead
    set_eval_frame = None

F = TypeVar("F", bound=Callable)


_PLANNED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # fz3.plan's copies of compiled modules


class PlannedWrapper(nn.Module):
    """fz3.plan's copy of a torch.compile wrapper: the same `_orig_mod` (so the same names),
    run as it is, nothing compiled (fz3/observe/fake.py)."""

    def __init__(self, orig: nn.Module) -> None:
        super().__init__()
        self._orig_mod = orig

    def forward(self, *args, **kwargs):
        return self._orig_mod(*args, **kwargs)


def mark_region(module: nn.Module) -> None:
    """fz3.plan's copy of a module compiled in place is a region too (the copy is not compiled)."""
    _PLANNED.add(module)


def compiled_in_place(module: nn.Module) -> bool:
    """`module.compile()` was called (or `module` is fz3.plan's copy of such a module)."""
    return getattr(module, "_compiled_call_impl", None) is not None or module in _PLANNED


def is_wrapper(module: nn.Module) -> bool:
    """`module` is what torch.compile(m) returns (an OptimizedModule; m is its `_orig_mod`), or
    fz3.plan's copy of one."""
    if isinstance(module, PlannedWrapper):
        return True
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing was compiled
    return eval_frame is not None and isinstance(module, eval_frame.OptimizedModule)


def is_compiled(module: nn.Module) -> bool:
    return compiled_in_place(module) or is_wrapper(module)


_SKIPPED: list = []


def outside_graph(fn: F) -> F:
    """`fn`, run by the compiler as a graph break with the compiler off inside it ([Note: hooks
    outside the graph])."""
    if set_eval_frame is None:
        return torch.compiler.disable(fn, recursive=True)

    def outside(*args, **kwargs):
        prior = set_eval_frame(None)
        try:
            return fn(*args, **kwargs)
        finally:
            set_eval_frame(prior)

    outside._torchdynamo_disable = True  # met while tracing: a graph break, not inlined
    outside._torchdynamo_disable_recursive = True
    outside._torchdynamo_disable_msg = "fz3's hooks run outside compiled regions"
    if not _SKIPPED:  # met as a frame of its own: run as it is (every wrapper shares one code)
        set_code_exec_strategy(outside.__code__, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.DEFAULT))
        _SKIPPED.append(outside.__code__)
    return outside


def regions(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules engine.compile() compiles: every repeated block (a child of an nn.ModuleList
    or nn.Sequential whose children are two or more modules of one class: a transformer's
    layers), the outermost such list in each branch; a model without one, each child of the
    root that holds params. Torch's regional compilation picks the same (Accelerate's
    `compile_regions`, torchtitan's per-block compile)."""
    found: list[tuple[str, nn.Module]] = []

    def visit(module: nn.Module, name: str) -> None:
        children = list(module.named_children())
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(children) >= 2 \
                and len({type(c) for _, c in children}) == 1 and not is_compiled(children[0][1]):
            found.extend((_join(name, n), c) for n, c in children)
            return
        for n, c in children:
            if not is_compiled(c):
                visit(c, _join(name, n))

    visit(model, "")
    if not found:
        found = [(n, c) for n, c in model.named_children()
                 if not is_compiled(c) and next(c.parameters(), None) is not None]
    return found


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def compile_engine(engine, backend, compile_kwargs: dict | None, schedule, compiled_autograd_enabled: bool
                   ) -> list[str]:
    """engine.compile(): compile `regions(engine.module)` in place (`module.compile(backend=...,
    **compile_kwargs)`) and make them the engine's fetch units ([Note: compiled regions]).
    Before the first forward only: the units, the core state and the hooks are built again,
    which a state that has run a pass cannot be. -> the names of the modules compiled.
    DeepSpeed: DeepSpeedEngine.compile, which compiles the whole module with every module a
    unit (a graph break at each); `schedule` (DeepCompile's passes) and compiled autograd are
    refused here, by name."""
    if schedule is not None:
        raise ValueError(f"engine.compile(schedule={schedule!r}): a schedule of DeepCompile passes; fz3 "
                         "has no DeepCompile, so schedule must be None")
    if compiled_autograd_enabled:
        raise ValueError("engine.compile(compiled_autograd_enabled=True): fz3's backward runs its hooks "
                         "eagerly (outside the graph), so compiled autograd is not supported; leave it False")
    kwargs = {} if compile_kwargs is None else compile_kwargs
    if not isinstance(kwargs, dict):
        raise TypeError(f"engine.compile(compile_kwargs={compile_kwargs!r}): expected a dict of "
                        "torch.compile keyword arguments (mode, fullgraph, dynamic, options) or None")
    if "backend" in kwargs:
        raise ValueError(f"engine.compile: backend given twice ({backend!r} and compile_kwargs['backend']="
                         f"{kwargs['backend']!r}); pass it as backend= only")
    if not engine.untouched:
        raise RuntimeError("engine.compile() after the engine ran a forward (or gathered params): its fetch "
                           "units are fixed by then. Call engine.compile() right after initialize, before "
                           "the first forward (as DeepSpeed scripts and Accelerate do), or compile the "
                           "model's blocks before fz3.initialize")
    found = regions(engine.module)
    for _, module in found:
        module.compile(backend=backend, **kwargs)
    if found:
        engine.units_changed()
    return [name for name, _ in found]


PROCESS_WIDE = ("graphs", "graph_breaks", "compiled_frames")
"""compile_stats' keys that count for the whole process (every engine and thread rank in it)."""


def compile_stats(engine) -> dict[str, int]:
    """stats()' compile keys. compiled_units: fetch units that are compiled regions. The rest are
    dynamo's process-wide counts (0 before anything was compiled): graphs compiled, graph breaks
    (dynamo counts one each time it traces past a break, so a steady state adds none, while
    the breaks it traced run at every call), frames compiled (a recompile adds one)."""
    units = len(engine.tables.compiled)
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return {"compiled_units": units, "graphs": 0, "graph_breaks": 0, "compiled_frames": 0}
    counters = utils.counters
    return {"compiled_units": units, "graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values()), "compiled_frames": counters["frames"]["total"]}


def _refuse_compiled_engine() -> None:
    """torch.compile(engine) returns a plain function (the engine is not an nn.Module), without
    backward, step or anything else of the engine's, and the compiler would trace the whole
    model with a graph break at every module: refused at its first call, saying what works."""
    raise TypeError("fz3: torch.compile(engine) is not supported: it returns a plain function without the "
                    "engine's backward() and step(). Call engine.compile(backend='inductor') instead (it "
                    "compiles the model's blocks, fz3's hooks outside their graphs), or compile the "
                    "blocks before fz3.initialize: for block in model.layers: block.compile()")


refuse_compiled_engine = outside_graph(_refuse_compiled_engine)  # raised eagerly: the compiler
# turns an exception it traces into a graph break and runs the frame again without itself
