"""`engine.generation(budget_bytes=None)`: a decode loop without a collective per token.

    engine.eval()
    with torch.no_grad(), engine.generation():          # every unit whole: no gather per token
        out = engine.module.generate(ids, max_new_tokens=32)
    with engine.generation(budget_bytes=2**30): ...      # the units that fit stay whole
    engine.train()                                       # training goes on as before

Entering gathers the units the core picks for the budget (fz3/core/param/whole.py, [Note:
generation keeps units whole]) and holds them, as `fz3.gathered_parameters` holds what it is
given (fz3/core/param/hold.py): no release frees them, so every forward inside reads them as they
are; a unit left out is gathered per forward as usual. Rank 0's buffers are broadcast once at the
entry instead of before every forward (a forward per token would be a broadcast per token): a
decode loop in eval mode does not change them. Leaving frees what the entry gathered; the next
forward gathers as before. Every rank must enter it together (it gathers), and run the same
number of forwards inside (the units left out are gathered in each).
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from fz3.core.events import Hold, Unhold
from fz3.core.param.whole import gathered_per_pass, keep_whole
from fz3.interpreters import agreement
from fz3.interpreters.agree import every_rank
from fz3.shell.memory import human_bytes


@contextlib.contextmanager
def generation(engine, budget_bytes: Optional[int] = None) -> Iterator[dict]:
    """The block's forwards read the kept units whole; -> a dict saying what was kept."""
    if torch._C._current_graph_task_id() != -1:
        raise RuntimeError("engine.generation() was entered inside a backward (a hook or a grad function): a "
                           "decode loop runs forwards, after the backward and step(); enter it there")
    if engine.generating:
        raise RuntimeError("engine.generation() is already open on this engine: enter it once around the decode loop")
    spec, elem = engine.spec, engine.store.dtype.itemsize
    if budget_bytes is not None and (isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int)
                                     or budget_bytes < 0):
        raise ValueError(f"engine.generation(budget_bytes={budget_bytes!r}): the budget is an int of bytes >= 0 "
                         "for the full params kept whole, or None for the whole model")
    whole = keep_whole(spec, None if budget_bytes is None else budget_bytes // elem)
    left = gathered_per_pass(spec, whole)
    if budget_bytes is not None and left and not whole.modules:
        smallest = min(((sum(spec.params[p].numel for p in m.params if not spec.params[p].persistent), m.name)
                        for m in spec.modules if m.id in set(left)))
        raise ValueError(f"engine.generation(budget_bytes={budget_bytes:,}) keeps no layer whole: the smallest, "
                         f"{smallest[1] or '(root)'!r}, needs {smallest[0] * elem:,} bytes "
                         f"({human_bytes(smallest[0] * elem)}) in {engine.store.dtype}; give at least that, or None "
                         "for the whole model")
    every_rank(engine, agreement.GENERATION)
    engine.buffers.sync()
    engine.generating = True
    engine.apply(Hold(params=whole.params))
    try:
        yield {"kept_modules": len(whole.modules), "kept_bytes": whole.numel * elem,
               "gathered_per_forward": len(left)}
    finally:
        engine.apply(Unhold(params=whole.params, stale=False))
        engine.generating = False
