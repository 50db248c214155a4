"""A deliberately naive model of gradient accumulation, and a scenario driver for the real one.

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

from typing import NamedTuple, Optional, Sequence

import torch
import fz3.testing.extra  # noqa: F401 - Hypothesis, or an ImportError naming the test extra
from hypothesis import strategies as st

from fz3.core.grad import epilogue as ep
from fz3.core.grad import grads
from fz3.config.config import Config
from fz3.core.grad.grads import GradState
from fz3.core.ids import ParamId
from fz3.core.grad.invariants import check_drained, check_grad_state, check_reduce_log
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
Action = tuple  # ("report", p) | ("flush",) | ("task",)


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


class Scenario(NamedTuple):
    """One accumulation window: per micro-step, the order of grad events."""

    world_size: int
    params: tuple[tuple[int, str], ...]  # (numel, comm dtype) per ParamId
    bucket_size: int
    overlap_comm: bool
    seed: int
    micro_steps: tuple[tuple[Action, ...], ...]  # len = gradient_accumulation_steps
    comm: Optional[str] = None  # communication_data_type
    prescale: bool = False  # prescale_gradients
    predivide: float = 1.0  # gradient_predivide_factor
    in_place: bool = False  # the reduce-scatter reads grads in place (grads are held)
    hold: int = 0  # the carrier's hold budget (init_grad_state's hold_budget; 0: none)

    def config(self, path: str) -> Config:
        return Config(reduce_bucket_size=self.bucket_size, overlap_comm=self.overlap_comm,
                      gradient_accumulation_steps=len(self.micro_steps),
                      communication_data_type=self.comm, prescale_gradients=self.prescale,
                      gradient_predivide_factor=self.predivide, **PATHS[path])


@st.composite
def scenarios(draw: st.DrawFn, max_params: int = 6) -> Scenario:
    """World sizes 1-4, numels 0-40, buckets from 1 element (often at an edge), 1-4 micro-steps,
    each a whole backward (in reverse param order or shuffled) or any run of reports, flushes
    and new graph tasks; any comm dtype, prescale on or off, a predivide factor, grads held by
    an in-place reduce-scatter or not, under a hold budget or none."""
    params = draw(st.lists(st.tuples(st.integers(0, 40), st.sampled_from(sorted(DTYPES))),
                           min_size=1, max_size=max_params))
    n = len(params)
    action = st.one_of(st.tuples(st.just("report"), st.integers(0, n - 1)),
                       st.just(("flush",)), st.just(("task",)))
    backward = tuple(("report", p) for p in reversed(range(n)))  # the order autograd reports
    step = st.one_of(st.just(backward), st.permutations(backward).map(tuple),
                     st.lists(action, max_size=3 * n).map(tuple))
    steps = draw(st.lists(step, min_size=1, max_size=4))
    bucket = draw(bucket_sizes([p[0] for p in params]))
    return Scenario(draw(st.integers(1, 4)), tuple(params), bucket, draw(st.booleans()),
                    draw(st.integers(0, 2**32 - 1)), tuple(steps), draw(st.sampled_from(COMMS)),
                    draw(st.booleans()), draw(st.sampled_from(PREDIVIDES)), draw(st.booleans()),
                    draw(st.one_of(st.just(0), bucket_sizes([p[0] for p in params]))))


def bucket_sizes(numels: Sequence[int]) -> st.SearchStrategy[int]:
    """1-64 elements, often at an edge: the fill of a run of grads, plus -1, 0 or +1.

    Suffix runs are the fills a backward in reverse param order reaches from an empty bucket.
    """
    n, d = len(numels), st.integers(-1, 1)
    run = st.builds(lambda i, j, d: max(1, sum(numels[i:j + 1]) + d),
                    st.integers(0, n - 1), st.integers(0, n - 1), d)
    suffix = st.builds(lambda i, d: max(1, sum(numels[i:]) + d), st.integers(0, n - 1), d)
    return st.one_of(st.integers(1, 64), run, suffix)


def run_scenario(sc: Scenario, path: str) -> tuple[SimulatedWorld, GradState, NaiveGrads]:
    """Drive the core through one whole window on `path`, checking invariants as it goes."""
    config = sc.config(path)
    spec = grad_spec([n for n, _ in sc.params], sc.world_size)
    dtypes = [DTYPES[d] for _, d in sc.params]
    world = SimulatedWorld(spec, config=config, grad_dtypes=dtypes)
    naive = NaiveGrads([n for n, _ in sc.params], dtypes, sc.world_size)
    state = grads.init_grad_state(spec, in_place_reduce_scatter=sc.in_place, hold_budget=sc.hold)
    gen = torch.Generator().manual_seed(sc.seed)
    for actions in sc.micro_steps:
        start, reported, task, seen = len(world.log), [], 0, set()
        for act in actions:
            if act[0] == "task":
                task, seen = task + 1, set()
                continue
            if act[0] == "flush":
                state, eff = grads.flush(state, config=config)
            else:
                p = ParamId(act[1])
                if p in seen:  # a second report in one graph task is an error (tested apart)
                    continue
                seen.add(p)
                reported.append(p)
                g = small_int_grads(gen, sc.params[p][0], sc.world_size, dtypes[p],
                                    grad_multiple(config, sc.world_size))
                naive.add(p, g)
                world.accumulate_grad(p, g)
                state, eff = grads.bucket_add(state, p, config=config, dtype=sc.params[p][1],
                                              graph_task=task)
                check_placement(eff, p, expected_placement(path, sc.in_place, sc.params[p][0],
                                                           sc.bucket_size, sc.hold))
            world.run(eff)
            check_bucket_sizes(eff, path, sc.in_place, sc.bucket_size, sc.hold)
            check_grad_state(state, config=config)
        state, eff = ep.epilogue(state, config=config)
        world.run(eff)
        check_drained(state, eff, config=config)
        check_reduce_log(world.log[start:], reported, config=config)
        state, eff = ep.micro_step_end(state, config=config)  # step(): the last one averages
        world.run(eff)
    return world, state, naive


def divisor(sc: Scenario) -> int:
    return sc.world_size * len(sc.micro_steps)


_BACKWARD = (("report", 2), ("report", 1), ("report", 0))
EDGES = [  # permanent examples: shrunk failures and edges the search reaches only sometimes
    # re-reported in a new graph task while its first grad still sits in the bucket
    Scenario(1, ((0, "float32"),), 1, False, 0, ((("report", 0), ("task",), ("report", 0)),)),
    Scenario(2, ((3, "float32"), (2, "float64")), 8, True, 1,
             ((("report", 1), ("report", 0), ("task",), ("report", 1), ("flush",)),)),
    # the bucket filled to capacity exactly (3 + 4 = 7), then one element past it (7 + 1 = 8)
    Scenario(2, ((1, "float32"), (4, "float32"), (3, "float32")), 7, True, 2, (_BACKWARD,)),
    # two micro-steps; a bucket of one element: every grad bigger than 1 is reduced alone
    Scenario(3, ((5, "float32"), (1, "float32"), (0, "float32")), 1, False, 3,
             (_BACKWARD, (("report", 0),))),
    # prescale on 3 ranks, two micro-steps, mixed grad dtypes reduced in one bf16 bucket
    Scenario(3, ((4, "float32"), (3, "float64"), (2, "float32")), 5, True, 4,
             (_BACKWARD, _BACKWARD), "bf16", True),
    # a predivide factor, fp16 comm, a grad bigger than the bucket (reduced from param.grad)
    Scenario(2, ((6, "float64"), (1, "float32")), 4, False, 5, (_BACKWARD[1:], _BACKWARD[1:]),
             "fp16", False, 4.0),
    # grads held for an in-place reduce-scatter (HoldGrad), cast to bf16, one re-reported in a
    # new graph task while held
    Scenario(2, ((3, "float32"), (2, "float64")), 8, True, 6,
             ((("report", 1), ("report", 0), ("task",), ("report", 1), ("flush",)),), "bf16",
             in_place=True),
]
