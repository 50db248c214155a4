"""Count the ATen ops one training step runs in a rank, and the ones that make the host wait for
the device (issue #48's measure), under a TorchDispatchMode.

    with LaunchCount() as c: system.step(x, y)
    c.snapshot()   {"launches": n, "syncs": {op: n}, "sync_total": n, "peer_reads": n, "top": [(op, n), ...]}

A launch is an op that reaches a kernel: every ATen op the mode sees (below autograd and the
composite decompositions) except views, the metadata-only ops in FREE (and FSDP2's profiler
ranges), and c10d's ops: collectives are not kernels of the step's compute, and fz3's gloo
carriers call the process group directly, past the dispatcher, so they could not be compared
(bench/compare.py counts every system's collectives). A sync is an op whose result the host reads from the device:
`aten._local_scalar_dense` (`.item()`, `float(t)`, `bool(t)`, `if t:`), `aten.equal`
(`torch.equal`), `aten.is_nonzero`; on an accelerator each stops the host from running ahead.
`Tensor.tolist()` and `.numpy()` of a CPU tensor read its memory without an ATen op, so a CPU
count cannot see them; on CUDA they go through a copy to the host, counted as a launch. The
harness's own `loss.item()` at the end of each system's step is one sync of every row. An
optimizer's `state["step"]` counters stay on the host on an accelerator too (torch keeps them on
the CPU unless capturable or fused), so their reads in torch.optim's `_get_value` are no sync
and are left out, as are fz3's reads of its copy of the last step's verdict (HOST_READS). fz3's
divergence check reads its peers' descriptors, host tensors on every backend: counted apart
(`peer_reads`), a wait for the peers, not the device.
"""
from __future__ import annotations

import os
import sys
from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

SYNCS = {"aten::_local_scalar_dense", "aten::equal", "aten::is_nonzero"}
# no kernel: shape and storage bookkeeping the dispatcher still routes
FREE = {"aten::detach", "aten::lift_fresh", "aten::set_", "aten::resize_", "aten::empty.memory_format",
        "aten::empty_strided", "aten::_has_compatible_shallow_copy_type", "aten::sym_size", "aten::sym_stride",
        "aten::sym_numel", "aten::sym_storage_offset", "aten::is_same_size", "aten::record_stream",
        "profiler::_record_function_enter_new", "profiler::_record_function_exit"}  # FSDP2's record_function


HOST_READS = ((os.path.join("optim", "optimizer.py"), "_get_value"),
              (os.path.join("fz3", "shell", "verdict.py"), "read"),
              (os.path.join("fz3", "shell", "verdict.py"), "scale_read"))
PEER_READS = ((os.path.join("fz3", "interpreters", "agreement.py"), "_resolve"),
              (os.path.join("fz3", "interpreters", "agreement.py"), "all_reduce_sum"))


def _read_of() -> str | None:
    """"host" where the op reads data that is host memory on an accelerator too: a step counter
    in torch.optim's `_get_value` (torch keeps them on the host unless capturable or fused), or
    fz3's copy of the last step's verdict (fz3/shell/verdict.py `read`: pinned host memory,
    waited for by its own event, queued a step before); "peers" where it is fz3's divergence
    check reading its peers' descriptors (host tensors over a gloo side group on NCCL and HCCL:
    a wait for the peers, not for the device); else None."""
    f = sys._getframe(2)
    while f is not None:
        where = (f.f_code.co_filename, f.f_code.co_name)
        if any(where[1] == name and where[0].endswith(path) for path, name in HOST_READS):
            return "host"
        if any(where[1] == name and where[0].endswith(path) for path, name in PEER_READS):
            return "peers"
        f = f.f_back
    return None


class LaunchCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.peers = 0  # the divergence check's reads of its peers' descriptors

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        overload = f"{name}.{func._overloadname}" if func._overloadname != "default" else name
        if name.startswith("c10d::"):
            pass
        elif name in SYNCS:
            read = _read_of()
            if read is None:
                self.ops[name] += 1
            elif read == "peers":
                self.peers += 1
        elif not func.is_view and name not in FREE and overload not in FREE:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    def snapshot(self) -> dict:
        counts = {k: v for k, v in self.ops.items() if v}
        syncs = {k: v for k, v in counts.items() if k in SYNCS}
        launches = {k: v for k, v in counts.items() if k not in SYNCS}
        return {"launches": sum(launches.values()), "syncs": syncs, "sync_total": sum(syncs.values()),
                "peer_reads": self.peers,
                "top": sorted(launches.items(), key=lambda kv: -kv[1])[:12]}
