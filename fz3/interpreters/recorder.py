"""The recording interpreter: runs no collective, keeps the effect log and counts the work.

Used to print what the core decides (examples, debugging), to compare two ranks' decisions
(I6), and to count communication against the analytic ZeRO-3 volume (bench).

    rec = Recorder(spec)
    rec.run(effects)          # append, count
    print(rec.format())       # one effect a line, with param names
    rec.counts                # {"AllGather": 12, "prefetch": 7, "gathered_numel": ..., ...}
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable

from fz3.core.effects import AllGather, Free, Refresh, Wait
from fz3.core.spec import ModelSpec


class Recorder:
    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.log: list = []
        self.counts: Counter[str] = Counter()

    def run(self, effects: Iterable) -> None:
        for e in effects:
            self.log.append(e)
            self.counts[type(e).__name__] += 1
            match e:
                case AllGather(params=ps, prefetch=pre):
                    # padded numel moved into this rank's full buffers: shard * W per param
                    n = sum(self.spec.params[p].shard_numel for p in ps) * self.spec.world_size
                    self.counts["gathered_numel"] += n
                    self.counts["prefetch" if pre else "on_demand"] += 1
                case Refresh(params=ps):  # gathered again in place
                    n = sum(self.spec.params[p].shard_numel for p in ps) * self.spec.world_size
                    self.counts["gathered_numel"] += n
                    self.counts["refreshed_params"] += len(ps)
                case Free(params=ps):
                    self.counts["freed_params"] += len(ps)
                case Wait():
                    pass

    def format(self) -> str:
        return "\n".join(self.describe(e) for e in self.log)

    def describe(self, e: object) -> str:
        """An effect with param ids replaced by their names."""
        parts = []
        for name, v in zip(e._fields, e):
            if name == "params":
                v = "[" + ", ".join(self.spec.params[p].name for p in v) + "]"
            elif name == "param":
                v = self.spec.params[v].name
            parts.append(f"{name}={v}")
        return f"{type(e).__name__}(" + ", ".join(parts) + ")"
