"""fz3's configuration: DeepSpeed's stage-3 knobs, with DeepSpeed's names and defaults.

    Config(...)                        frozen; validated on construction
    Config.from_deepspeed(ds_dict)     a real DeepSpeed JSON dict -> Config

Every transition of the core takes the config as an explicit keyword argument, so it shows in
reprs and in Hypothesis failure output.

[Note: unknown keys] A DeepSpeed config that names a key fz3 does not know is almost always a
typo ("stage3_prefetch_bucket_sise") that DeepSpeed itself would silently drop. fz3 raises,
naming the key. Keys DeepSpeed knows but fz3 does not need (steps_per_print, ...) are accepted
and listed in one warning. A feature fz3 lacks (offload, fp16 loss scaling, stage != 3) raises.
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Mapping

COMPUTE_DTYPES = ("fp32", "bf16")
GLOO_COLLECTIVES = ("p2p", "all_reduce", "native")


@dataclass(frozen=True)
class Config:
    """DeepSpeed ZeRO-3 settings (`zero_optimization` names without the `stage3_` prefix).

    Sizes are in elements (numel), as in DeepSpeed.
    """

    prefetch_bucket_size: int = 50_000_000  # numel prefetched at most per fetch; 0 turns prefetch off
    max_live_parameters: int = 1_000_000_000  # prefetch never lifts live full-param numel past this
    max_reuse_distance: int = 1_000_000_000  # keep a param if reused within this numel ahead
    param_persistence_threshold: int = 100_000  # params this small stay gathered all step
    reduce_bucket_size: int = 500_000_000  # IPG bucket capacity in grad elements
    contiguous_gradients: bool = True
    reduce_scatter: bool = True  # False (with contiguous_gradients): all-reduce + local slice
    overlap_comm: bool = True  # gathers and reduces on their own streams
    gradient_accumulation_steps: int = 1
    gradient_clipping: float = 0.0  # global grad-norm clip; 0 = off
    compute_dtype: str = "fp32"  # "fp32" | "bf16"; master shards are always fp32
    debug_checks: bool = False  # shell runs the core's check_* invariants after each event
    # fz3 only, gloo only: what carries an all-gather and a reduce_scatter-path reduce, one of
    # GLOO_COLLECTIVES. "p2p": isend/irecv between every pair of ranks (fz3/interpreters/p2p.py);
    # "all_reduce": an all-reduce (SUM) of the zero-padded rows (gather: x + 0 == x, a -0.0 comes
    # back as +0.0) or of the bucket, keeping this rank's slices (reduce: the allreduce path's
    # data plane, same partitions, I3); "native": gloo's allgather / reduce_scatter. Here p2p is
    # the fastest at both benchmark sizes, gloo's reduce_scatter the slowest, about twice its
    # all-reduce (bench/gloo_collectives.py, bench/RESULTS.md).
    gloo_all_gather: str = "p2p"
    gloo_reduce_scatter: str = "p2p"

    def __post_init__(self) -> None:
        for name in ("prefetch_bucket_size", "max_live_parameters", "max_reuse_distance",
                     "param_persistence_threshold"):
            _check_int(name, getattr(self, name), low=0)
        _check_int("reduce_bucket_size", self.reduce_bucket_size, low=1)
        _check_int("gradient_accumulation_steps", self.gradient_accumulation_steps, low=1)
        for name in ("contiguous_gradients", "reduce_scatter", "overlap_comm", "debug_checks"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Config.{name} must be a bool, got {getattr(self, name)!r}")
        clip = self.gradient_clipping
        if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip >= 0:
            raise ValueError(f"Config.gradient_clipping must be a number >= 0 (0 = off), got {clip!r}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"Config.compute_dtype must be one of {COMPUTE_DTYPES}, "
                             f"got {self.compute_dtype!r}")
        for name in ("gloo_all_gather", "gloo_reduce_scatter"):
            if getattr(self, name) not in GLOO_COLLECTIVES:
                raise ValueError(f"Config.{name} must be one of {GLOO_COLLECTIVES}, "
                                 f"got {getattr(self, name)!r}")
        if not self.contiguous_gradients and not self.reduce_scatter:
            raise ValueError("contiguous_gradients=False needs reduce_scatter=True: the all-reduce "
                             "path reduces one contiguous bucket (DeepSpeed has the same rule)")

    @property
    def reduce_path(self) -> str:
        """'allreduce' (contiguous bucket, keep own slice) or 'reduce_scatter'."""
        return "reduce_scatter" if self.reduce_scatter else "allreduce"

    def replace(self, **changes: object) -> "Config":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_deepspeed(cls, ds: Mapping[str, object]) -> "Config":
        """Build a Config from a DeepSpeed JSON config dict (see the module note)."""
        from fz3.core._deepspeed_keys import translate

        fields, ignored = translate(ds)
        if ignored:
            warnings.warn("fz3 accepts but does not use these DeepSpeed keys: " + ", ".join(ignored),
                          stacklevel=2)
        return cls(**fields)


def _check_int(name: str, value: object, *, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"Config.{name} must be an int (numel), got {value!r}")
    if value < low:
        raise ValueError(f"Config.{name} must be >= {low}, got {value}")
