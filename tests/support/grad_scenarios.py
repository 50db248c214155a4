"""The gradient lifecycle's scenario driver: one accumulation window of drawn grad reports,
flushes and new graph tasks, run through the real core (bucket_add / flush / epilogue ->
effects -> SimulatedWorld) beside the naive model of fz3/testing/grad_naive.py, with the
invariants checked after every transition. Used by property_tests/test_grad_properties.py and
its teeth; the naive model and the placement rules it checks stay in the package.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from hypothesis import strategies as st

from fz3.config.config import Config
from fz3.core.grad import epilogue as ep
from fz3.core.grad import grads
from fz3.core.grad.grads import GradState
from fz3.core.grad.invariants import check_drained, check_grad_state, check_reduce_log
from fz3.core.ids import ParamId
from fz3.interpreters.simulated import SimulatedWorld
from fz3.testing.grad_naive import (COMMS, DTYPES, PATHS, PREDIVIDES, NaiveGrads, bucket_sizes, check_bucket_sizes,
                                    check_placement, expected_placement, grad_multiple, grad_spec, small_int_grads)

Action = tuple  # ("report", p) | ("flush",) | ("task",)


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
