"""What autograd saves of a gathered param is a name, not its memory.

[Note: saved views of gathered params] `F.linear(x, w)` records `mm(x, w.t())`, and autograd
saves `w.t()` for the backward: a view that holds the gathered full value's memory. Freeing the
param after its forward (`.data = empty`) then frees nothing: every Linear's full weight stayed
alive from its forward to its backward, and the backward gathered it a second time beside the
old copy. max_live_parameters bounded the core's count but not the memory (the 0.1 B GPT of
bench/diagnostics/memory.py held 738 MiB of gathered buffers per rank for a 5e7-param budget, in a probe
that counted the pool's buffers still in use; tests/test_saved_views.py checks it).

So, while a pass that records a graph runs, fz3 installs saved-tensor hooks: a saved tensor
that lies in a gathered param's full value (not the Parameter itself, which autograd saves as
the variable and which follows .data) is packed as (param, shape, stride, offset), and unpacked
in the backward as the same view of the param's value then -- which the core has gathered again
before the module's backward (DeepSpeed gets the same effect by replacing F.linear with an
autograd Function that saves the weight Parameter; FSDP2 by resizing the storage to 0 and
gathering into it again).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from fz3.core.pvec import Log
from fz3.shell.compiled import outside_graph


class SavedView(NamedTuple):
    param: int
    shape: torch.Size
    stride: tuple[int, ...]
    offset: int  # in the param's full value
    forward: int = 0  # the root forward that saved it (SavedParams.forwards then)


class SavedParams:
    """The pack / unpack pair for torch.autograd.graph.saved_tensors_hooks, over a tensor store."""

    def __init__(self, store, names: list[str], param_ids: dict[int, int], watch: bool = True) -> None:
        self.store, self.names, self.param_ids = store, names, param_ids
        self.watch = watch  # fz3.core.calls.saves_matter: no hooks where no param is ever freed
        self.log: Log[int] = Log()  # params saved for backward in this pass, in order (the core
        # reads which ones a call saved: [Note: backward reads no param], fz3/core/calls.py)
        self.hooks: torch.autograd.graph.saved_tensors_hooks | None = None  # open in a root forward
        self.forwards = 0  # root forwards begun

    def begin(self) -> None:
        """A root forward starts: a fresh log, and the hooks open (until `end`)."""
        self.log = Log()
        self.forwards += 1
        if self.hooks is None and self.watch:
            # [Note: hooks outside the graph] (compiled.py): a compiled region's saves come here too
            self.hooks = torch.autograd.graph.saved_tensors_hooks(outside_graph(self.pack), outside_graph(self.unpack))
            self.hooks.__enter__()

    def end(self) -> None:
        """The root forward ended: autograd saves nothing more of this pass."""
        if self.hooks is not None:
            self.hooks.__exit__(None, None, None)
            self.hooks = None

    def position(self) -> int:
        """The log's length now; -1 outside a root forward (no saves are watched)."""
        return -1 if self.hooks is None else len(self.log)

    def pack(self, t: torch.Tensor):
        # a plain tensor (most saves: activations) skips Parameter's isinstance, a Python
        # metaclass check (~1 us, twice a saved tensor on the deep narrow GPT's 393 a step)
        if type(t) is not torch.Tensor and isinstance(t, nn.Parameter):
            p = self.param_ids.get(id(t))
            if p is not None:
                self.log = self.log.extend((p,))  # the backward reads the param as it is then
            return t
        if not self.store.full_spans:
            return t
        found = self.store.full_of(t)
        if found is None:
            return t
        self.log = self.log.extend((found[0],))
        return SavedView(found[0], t.shape, t.stride(), found[1], self.forwards)

    def unpack(self, x):
        if not isinstance(x, SavedView):
            return x
        full = self.store.params[x.param].data
        if full.numel() != self.store.shapes[x.param].numel():
            if x.forward != self.forwards:
                raise RuntimeError(f"fz3: the backward needs param {self.names[x.param]!r}, saved by a forward "
                                   f"of this engine that another forward ({self.forwards - x.forward} later) "
                                   "followed before this backward: fz3 runs one forward with grad per backward "
                                   "of an engine. Run the inputs through one forward (concatenate them, as "
                                   "TRL's DPO does), or call backward before the next forward")
            raise RuntimeError(f"fz3: the backward needs param {self.names[x.param]!r} (saved by its "
                               "forward) but it is not gathered now; was it read outside the module "
                               "that owns it, or changed between forward and backward?")
        return full.as_strided(x.shape, x.stride, full.storage_offset() + x.offset)
