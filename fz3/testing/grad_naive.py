"""A deliberately naive model of gradient accumulation (its scenario driver for the real core:
tests/support/grad_scenarios.py).

    naive:  sums[p] += sum over ranks of grad_r(p)        (full size, no buckets, no shards)
            at the boundary: rank r expects (sums[p] / (W * gas)) padded, [r*s, (r+1)*s)
    route:  per report, the one effect that takes the grad out of param.grad (PLACEMENT, by
            path and whether the reduce-scatter reads grads in place), or none
    real:   bucket_add / flush / epilogue (fz3.core) -> effects -> SimulatedWorld

The naive side slices with its own index arithmetic, never with fz3.data, so a bug in the data
plane cannot hide by being on both sides; its route is a table, never fz3.core.grad.grads. Grads are
small integers, so every sum is exact in fp32 and results are compared with torch.equal. The
naive model knows nothing of the comm dtype or the pre-division: whatever they are, the
partitions must end as the plain mean. To keep that exact, grads are multiples of W under
prescale_gradients (g / W is an integer again), the predivide factors are powers of two, and
every sum stays within bf16's exact integers (256).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import fz3.testing.extra  # noqa: F401 - Hypothesis, or an ImportError naming the test extra
from hypothesis import strategies as st

from fz3.config.config import Config
from fz3.core.spec import ModelSpec, build_spec
from fz3.interpreters.simulated import SimulatedWorld

DTYPES = {"float32": torch.float32, "float64": torch.float64}
PATHS = {  # name -> Config fields
    "allreduce": dict(contiguous_gradients=True, reduce_scatter=False),
    "reduce_scatter": dict(contiguous_gradients=True, reduce_scatter=True),
    "reduce_scatter_loose": dict(contiguous_gradients=False, reduce_scatter=True),
}
PLACEMENT = {  # path -> the effect a grad placed in a bucket gets, by in_place_reduce_scatter
    "allreduce": {False: "CopyToBucket", True: "CopyToBucket"},  # an all-reduce reads the bucket
    "reduce_scatter": {False: "CopyToBucket", True: "HoldGrad"},  # sent from the grad: no copy
    "reduce_scatter_loose": {False: None, True: None},  # no bucket buffer: read from param.grad
}
COMMS = (None, "fp32", "bf16", "fp16")  # Config.communication_data_type
PREDIVIDES = (1.0, 0.5, 2.0, 4.0)  # Config.gradient_predivide_factor: exact scalings


def grad_spec(numels: Sequence[int], world_size: int, replicas: int = 1) -> ModelSpec:
    """A flat model: params p0, p1, ... of these numels, all in one module; `replicas` groups of
    `world_size` ranks (hybrid sharding)."""
    return build_spec([(f"p{i}", n) for i, n in enumerate(numels)],
                      [("root", list(range(len(numels))), False)],
                      world_size=world_size, persistence_threshold=0, replicas=replicas)


def small_int_grads(gen: torch.Generator, numel: int, world_size: int, dtype: torch.dtype,
                    multiple: int = 1) -> list[torch.Tensor]:
    """One grad per rank, `multiple` x an integer in [-4, 4]: every sum of them is exact."""
    return [(torch.randint(-4, 5, (numel,), generator=gen) * multiple).to(dtype)
            for _ in range(world_size)]


def grad_multiple(config: Config, world_size: int) -> int:
    """W where each grad is divided by W before the reduce (prescale_gradients, or fp16 sums
    without a predivide factor), else 1: the quotients stay integers. Said here apart from
    grads.grad_predivide, so that a bug there is not copied into the data."""
    fp16_sums = (config.communication_data_type or config.compute_dtype) == "fp16"
    return world_size if config.prescale_gradients or (fp16_sums and config.gradient_predivide_factor == 1) else 1


class NaiveGrads:
    """Full-size running sums per param; sliced only when asked. `world_size` ranks in groups of
    `shard_world` (hybrid sharding; None: one group), each group holding every slice."""

    def __init__(self, numels: Sequence[int], dtypes: Sequence[torch.dtype], world_size: int,
                 shard_world: int | None = None):
        self.numels, self.dtypes, self.world_size = list(numels), list(dtypes), world_size
        self.shard_world = world_size if shard_world is None else shard_world
        self.reset()

    def reset(self) -> None:
        self.sums = [torch.zeros(n, dtype=d) for n, d in zip(self.numels, self.dtypes)]

    def add(self, param: int, rank_grads: Sequence[torch.Tensor]) -> None:
        for g in rank_grads:
            self.sums[param] = self.sums[param] + g.reshape(-1)

    def expected(self, param: int, rank: int, divisor: int) -> torch.Tensor:
        n, w = self.numels[param], self.shard_world
        s, i = (n + w - 1) // w, rank % w
        padded = torch.cat([self.sums[param] / divisor,
                            torch.zeros(s * w - n, dtype=self.dtypes[param])])
        return padded[i * s:(i + 1) * s]

    def check(self, world: SimulatedWorld, divisor: int) -> None:
        """Every rank's every partition equals the naive mean slice, bit for bit (I3)."""
        for r in range(self.world_size):
            for p in range(len(self.numels)):
                got, want = world.partitions[r][p], self.expected(p, r, divisor)
                if got.dtype != want.dtype or not torch.equal(got, want):
                    raise AssertionError(f"I3: rank {r} param p{p}: partition {got.tolist()} "
                                         f"({got.dtype}) != naive mean slice {want.tolist()}")


def naive_capacity(path: str, in_place: bool, bucket_size: int, hold: int) -> int:
    """A bucket's size: reduce_bucket_size, or the carrier's hold budget `hold` (0: none) where
    grads are held and it is smaller."""
    if PLACEMENT[path][in_place] == "HoldGrad" and hold:
        return min(bucket_size, hold)
    return bucket_size


def expected_placement(path: str, in_place: bool, numel: int, bucket_size: int, hold: int = 0) -> Optional[str]:
    """The effect (by name) bucket_add must give a grad of `numel` on `path`, or None: a grad
    bigger than the whole bucket (naive_capacity) is never placed (reduced alone, from
    param.grad)."""
    if numel > naive_capacity(path, in_place, bucket_size, hold):
        return None
    return PLACEMENT[path][in_place]


def check_bucket_sizes(effects: Sequence[object], path: str, in_place: bool, bucket_size: int, hold: int) -> None:
    """Every reduce of several grads fits naive_capacity: held grads never wait for a whole
    reduce_bucket_size when the carrier's hold budget is smaller."""
    most = naive_capacity(path, in_place, bucket_size, hold)
    for e in effects:
        if type(e).__name__ == "ReduceBucket" and len(e.slots) > 1 and sum(s.numel for s in e.slots) > most:
            raise AssertionError(f"{e} reduces {sum(s.numel for s in e.slots)} elements, more than the "
                                 f"bucket's {most} (reduce_bucket_size {bucket_size}, hold budget {hold})")


def check_placement(effects: Sequence[object], param: int, want: Optional[str]) -> None:
    """A report's effects take the grad of `param` out of param.grad as `want` says: one
    CopyToBucket or HoldGrad of it, or none of either (for it or any other param)."""
    got = [(type(e).__name__, e.param) for e in effects
           if type(e).__name__ in ("CopyToBucket", "HoldGrad")]
    expected = [] if want is None else [(want, param)]
    if got != expected:
        raise AssertionError(f"placement of p{param}: the core emitted {got}, the naive model "
                             f"expects {expected}")


def bucket_sizes(numels: Sequence[int]) -> st.SearchStrategy[int]:
    """1-64 elements, often at an edge: the fill of a run of grads, plus -1, 0 or +1.

    Suffix runs are the fills a backward in reverse param order reaches from an empty bucket.
    """
    n, d = len(numels), st.integers(-1, 1)
    run = st.builds(lambda i, j, d: max(1, sum(numels[i:j + 1]) + d),
                    st.integers(0, n - 1), st.integers(0, n - 1), d)
    suffix = st.builds(lambda i, d: max(1, sum(numels[i:]) + d), st.integers(0, n - 1), d)
    return st.one_of(st.integers(1, 64), run, suffix)

