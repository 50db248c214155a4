"""fz3's own switches, outside DeepSpeed's vocabulary: how the gloo backend carries collectives,
and the debug mode. `Config` keeps DeepSpeed's stage-3 knobs only.

    fz3.initialize(model, optimizer, config, options=fz3.Options(gloo_all_gather="native"))
    fz3.plan(model, config, ..., options=fz3.Options(...))

gloo_all_gather, gloo_reduce_scatter   what carries an all-gather and a reduce_scatter-path
    reduce on gloo, one of GLOO_COLLECTIVES (fz3/interpreters/carriers.py):
    "p2p": isend/irecv between every pair of ranks (fz3/interpreters/p2p.py), the default and
    the fastest here at both benchmark sizes; "all_reduce": an all-reduce (SUM) of the
    zero-padded rows (gather: x + 0 == x, a -0.0 comes back as +0.0) or of the bucket, keeping
    this rank's slices (reduce: the allreduce path's data plane, same partitions, I3);
    "native": gloo's allgather / reduce_scatter, the slowest (bench/diagnostics/gloo_collectives.py,
    bench/RESULTS.md). NCCL and HCCL always use their own collectives.
gloo_coalesce_numel   on the "p2p" carriers, params of at most this many elements travel packed,
    one message per peer for each group of them in one gather or reduce (fz3/interpreters/messages.py);
    larger ones are sent from where they lie. 0: every param its own message. The backends' own
    collectives pack every collective whole already
debug_checks   the shell runs the core's check_* invariants after each event (fz3/shell/checks.py),
    and holds every event a recorded pass answers against the full transition (fz3/core/replay.py)
replay   a steady-state pass is answered from the recording of an earlier one, event by event
    (fz3/core/replay.py): the same effects and states as the full transitions, at a compare and a
    lookup each, for the memory of the schedules kept (stats()["replay_schedules"]). False: every
    event takes the full transition
broadcast_buffers   rank 0's buffers (BatchNorm statistics, ...) are broadcast before each forward
    pass, before full_state_dict() and before a checkpoint save, so every rank's agree (DDP's
    broadcast_buffers, on by default as there; fz3/shell/buffers.py). False: each rank keeps
    its own
huge_pages   on CPU, each new buffer of 32 MiB or more that fz3 makes for itself (a gathered
    param's full value, a reduce's scratch, a grad segment) is advised to the kernel for 2 MiB
    pages before it is written (madvise MADV_HUGEPAGE; Linux with transparent huge pages
    "madvise" or "always"): [Note: huge pages for fresh buffers], fz3/data/pages.py. False: 4 KiB
    pages, as torch allocates them
shared_memory   True: gloo ranks all on one host (x86-64 Linux) send the point-to-point
    carrier's large messages (64 KiB or more) through rings in shared memory, one of 1 MiB a
    direction a pair of ranks, instead of over TCP: [Note: shared-memory carrier],
    fz3/interpreters/shared_memory.py. The rings hold W (W - 1) MiB of the host's /dev/shm while
    the ranks train, and files in /dev/shm are the process's business, so only when asked. False
    (the default): every message over gloo's TCP
host_step   offload_optimizer "cpu" or "nvme" steps the optimizer on a host pool apart from the
    ranks' device tensors, as on an accelerator (fz3/core/offload.py `host`: the grads copied to
    host buffers, the stepped masters copied back into the compute shards), even when the ranks
    compute on the CPU, where "device" and "host" are then two pools of host memory. For tests
    and for reading the accelerator's path on a machine without one. False (the default): on CPU
    ranks "cpu" moves nothing; on an accelerator the host step is always taken
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GLOO_COLLECTIVES = ("p2p", "all_reduce", "native")


@dataclass(frozen=True)
class Options:
    gloo_all_gather: str = "p2p"
    gloo_reduce_scatter: str = "p2p"
    gloo_coalesce_numel: int = 65_536
    debug_checks: bool = False
    broadcast_buffers: bool = True
    replay: bool = True
    huge_pages: bool = True
    # files in the host's /dev/shm: asked for by name only (the house rule: a library leaves the
    # process as it found it)
    shared_memory: bool = False
    host_step: bool = False

    def __post_init__(self) -> None:
        for name in ("gloo_all_gather", "gloo_reduce_scatter"):
            if getattr(self, name) not in GLOO_COLLECTIVES:
                raise ValueError(f"Options.{name} must be one of {GLOO_COLLECTIVES}, got {getattr(self, name)!r}")
        n = self.gloo_coalesce_numel
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"Options.gloo_coalesce_numel must be an int >= 0 (0: no packing), got {n!r}")
        for name in ("debug_checks", "broadcast_buffers", "replay", "huge_pages", "shared_memory", "host_step"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Options.{name} must be a bool, got {getattr(self, name)!r}")

    def replace(self, **changes: object) -> "Options":
        return dataclasses.replace(self, **changes)


def given(options: object, caller: str) -> Options:
    """The `options=` argument of `caller` (fz3.initialize, fz3.plan): None means the defaults."""
    if options is None:
        return Options()
    if not isinstance(options, Options):
        raise TypeError(f"{caller}: options must be a fz3.Options, got {type(options).__name__}")
    return options
