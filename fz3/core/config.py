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
    # fz3 only: on gloo, run a reduce_scatter-path reduce as one all-reduce of the bucket and keep
    # this rank's slices (the allreduce path's data plane: same partitions, I3). Here gloo's
    # reduce_scatter takes about twice its all-reduce of the same buffer, ~100 ms of it blocking
    # in the issue call, plus fz3's rank-interleaved packing (bench/gloo_collectives.py,
    # bench/RESULTS.md). False: gloo's own.
    gloo_reduce_scatter_via_allreduce: bool = True
    # fz3 only: on gloo, run an all-gather whose output has at least
    # gloo_all_gather_via_allreduce_min_bytes as an all-reduce (SUM) of a zeroed (W*S,) buffer
    # holding this rank's shards in its row: the same values (x + 0 == x; a -0.0 comes back as
    # +0.0), twice the wire bytes. Faster here for large gathers (the wide model's 48 and 64 MiB),
    # slower for small ones that overlap compute (the small model's 8 MiB): bench/RESULTS.md.
    gloo_all_gather_via_allreduce: bool = True
    gloo_all_gather_via_allreduce_min_bytes: int = 32 << 20

    def __post_init__(self) -> None:
        for name in ("prefetch_bucket_size", "max_live_parameters", "max_reuse_distance",
                     "param_persistence_threshold", "gloo_all_gather_via_allreduce_min_bytes"):
            _check_int(name, getattr(self, name), low=0)
        _check_int("reduce_bucket_size", self.reduce_bucket_size, low=1)
        _check_int("gradient_accumulation_steps", self.gradient_accumulation_steps, low=1)
        for name in ("contiguous_gradients", "reduce_scatter", "overlap_comm", "debug_checks",
                     "gloo_reduce_scatter_via_allreduce", "gloo_all_gather_via_allreduce"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Config.{name} must be a bool, got {getattr(self, name)!r}")
        clip = self.gradient_clipping
        if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip >= 0:
            raise ValueError(f"Config.gradient_clipping must be a number >= 0 (0 = off), got {clip!r}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"Config.compute_dtype must be one of {COMPUTE_DTYPES}, "
                             f"got {self.compute_dtype!r}")
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
