"""Properties of the gradient lifecycle: I3 and bucket accounting, over random scenarios.

A scenario is one accumulation window on W = 1-4 ranks: params of numel 0-40 with float32 or
float64 grads, a bucket of 1-64 elements (often smaller than one grad, often at the exact fill of
a run of grads, +-1), 1-4 micro-steps, each a whole backward (reverse param order or shuffled) or
any sequence of grad reports, explicit flushes and new graph tasks. EDGES (fz3/testing) are
permanent examples: shrunk failures and edges the search reaches only sometimes.
`run_scenario` checks bucket accounting as it goes (slots packed without overlap and within
capacity after every event; every reported grad reduced exactly once per backward, each reduce
followed by its writes and one DropGrads; no open bucket after an epilogue) and each report's
route against the naive table (CopyToBucket, HoldGrad under an in-place reduce-scatter, or
neither).
"""
import torch
from hypothesis import example, given

from fz3.testing.grad_naive import PATHS
from tests.support.grad_scenarios import EDGES, Scenario, divisor, run_scenario, scenarios


def check_i3(sc: Scenario, path: str) -> None:
    world, state, naive = run_scenario(sc, path)
    assert state.buckets == () and state.micro_step == 0 and state.averaged
    naive.check(world, divisor(sc))


def with_edges(test):
    for sc in EDGES:
        test = example(sc)(test)
    return test


@with_edges
@given(scenarios())
def test_i3_allreduce_path(sc):
    check_i3(sc, "allreduce")


@with_edges
@given(scenarios())
def test_i3_reduce_scatter_path(sc):
    check_i3(sc, "reduce_scatter")
    check_i3(sc, "reduce_scatter_loose")


@with_edges
@given(scenarios())
def test_paths_give_identical_partitions(sc):
    worlds = {path: run_scenario(sc, path)[0] for path in PATHS}
    ref = worlds.pop("allreduce")
    for path, w in worlds.items():
        for r in range(sc.world_size):
            for p in range(len(sc.params)):
                assert torch.equal(w.partitions[r][p], ref.partitions[r][p]), (path, r, p)
