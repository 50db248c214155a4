"""All ranks or none: before a multi-rank operation changes anything (loading a checkpoint or
weights, publishing a save), every rank learns which ranks failed, so all raise together or all
go on. One all-reduce replaces a barrier that a failed rank would never reach (a hang until the
process group's timeout)."""
from __future__ import annotations

import torch
import torch.distributed as dist


def failed_ranks(engine, failed: bool) -> list[int]:
    """The ranks of `engine`'s group that report `failed`, the same list on every rank."""
    flags = torch.zeros(engine.world_size, dtype=torch.int32, device=engine.store.device)  # (W,)
    flags[engine.rank] = int(failed)
    dist.all_reduce(flags, group=engine.group)
    return [r for r, f in enumerate(flags.tolist()) if f]
