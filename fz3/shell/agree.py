"""All ranks or none: before a multi-rank operation changes anything (loading a checkpoint or
weights, publishing a save), every rank learns which ranks failed, so all raise together or all
go on. One all-reduce replaces a barrier that a failed rank would never reach (a hang until the
process group's timeout)."""
from __future__ import annotations

import torch


def failed_ranks(engine, failed: bool) -> list[int]:
    """The ranks of `engine`'s group that report `failed`, the same list on every rank."""
    flags = torch.zeros(engine.world_size, dtype=torch.int32, device=engine.store.device)  # (W,)
    flags[engine.rank] = int(failed)
    engine.transport.all_reduce(flags)
    return [r for r, f in enumerate(flags.tolist()) if f]
