"""logging.getLogger("fz3") (fz3/shell/log.py): the INFO summary at initialize, a DEBUG line per
optimizer step, and a WARNING when recorded module orders keep being dropped, naming where."""
from __future__ import annotations

import logging
import re

import pytest
import torch
from torch import nn

from fz3 import launch

pytestmark = pytest.mark.timeout(240)


class Flip(nn.Module):
    """Calls a then b, or b then a: `order` decides, per pass."""

    def __init__(self, order) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.order, self.passes = order, 0

    def forward(self, x):
        first, second = (self.b, self.a) if self.order(self.passes) else (self.a, self.b)
        self.passes += 1
        return second(first(x))


def _run(rank: int, world: int, flip: str, config: dict) -> list[tuple[str, str]]:
    import fz3
    records: list[tuple[str, str]] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append((record.levelname, record.getMessage()))

    log = logging.getLogger("fz3")
    log.addHandler(Keep())
    log.setLevel(logging.DEBUG)
    order = {"every other pass": lambda i: i % 2 == 1, "once": lambda i: i >= 2}[flip]
    model = Flip(order)
    engine = fz3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            fz3.Config(param_persistence_threshold=0, **config))
    for _ in range(7):
        engine.backward(engine(torch.ones(2, 8)).sum())
        engine.step()
    records.append(("STATS", engine.stats()))
    return records


def test_initialize_says_what_it_set_up_and_each_step_what_it_did():
    ranks = launch.run(_run, world_size=2, args=("once", {"reduce_bucket_size": 1000}), timeout=200)
    info = [m for lvl, m in ranks[0] if lvl == "INFO"]
    assert len(info) == 1 and not [m for lvl, m in ranks[1] if lvl == "INFO"]  # rank 0 only
    summary = info[0]
    for part in ("2 ranks", "backend gloo", "all-gather by p2p", "reduce-scatter by p2p", "4 params sharded",
                 "(144 elements)", "0 persistent", "reduce_bucket_size=1000", "param_persistence_threshold=0"):
        assert part in summary, (part, summary)
    for rank, records in enumerate(ranks):
        debug = [m for lvl, m in records if lvl == "DEBUG"]
        stats = records[-1][1]
        assert len(debug) == 7, debug
        lines = [re.fullmatch(rf"fz3 rank {rank} step {i + 1}: (\d+) all-gathers \((\d+) on demand, (\d+) "
                              r"prefetched\), .* gathered, (\d+) reduces, .* reduced; trace (\w+), (\d+) "
                              r"invalidations; peak live [\d,]+ params; compiler: (\d+) graphs, (\d+) graph "
                              r"breaks, (\d+) frames \(\+\d+, \+\d+, \+\d+ this step\) over (\d+) compiled units", m)
                 for i, m in enumerate(debug)]
        assert all(lines), debug
        per_step = [[int(g) for g in (m[1], m[2], m[3], m[4])] for m in lines]
        assert [sum(col) for col in zip(*per_step)] == [stats["all_gather"], stats["all_gather_on_demand"],
                                                        stats["all_gather_prefetch"], stats["reduce"]]
        assert lines[-1][5] == stats["trace"] and int(lines[-1][6]) == stats["trace_invalidations"]
        assert [int(g) for g in lines[-1].groups()[6:]] == [stats["graphs"], stats["graph_breaks"],
                                                          stats["compiled_frames"], stats["compiled_units"]]


def test_orders_dropped_again_and_again_are_a_warning_naming_where():
    for rank, records in enumerate(launch.run(_run, world_size=2, args=("every other pass", {}), timeout=200)):
        warnings = [m for lvl, m in records if lvl == "WARNING"]  # passes 2, 4, 6 depart
        assert warnings, records
        assert f"fz3 rank {rank}: the module order changed again (2 recorded plans in a row dropped)" in warnings[0]
        assert "fetch 1 was 'b' where the plan expected 'a'" in warnings[0], warnings[0]


def test_one_change_of_order_is_not_a_warning():
    for records in launch.run(_run, world_size=2, args=("once", {}), timeout=200):
        assert not [m for lvl, m in records if lvl == "WARNING"], records
