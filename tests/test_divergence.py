"""Ranks that run different modules raise fz3.DivergenceError, every one of them, before the
mismatched collective's data moves, instead of hanging (fz3/interpreters/agreement.py).

A branch that one rank takes and the others do not, in forward (an extra module) and in backward
(a detached output: no backward through two modules), on 2 and 3 ranks, at the first step (the
trace is recording: on-demand gathers) and at the third (prefetch along a recorded trace). Every
rank must end with the error, naming each rank's position, in well under the test's timeout.
"""
from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from fz3 import launch

pytestmark = pytest.mark.timeout(300)


class Branchy(nn.Module):
    def __init__(self, where: str, odd: int, at_step: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.extra, self.c = (nn.Linear(16, 16) for _ in range(4))
        self.where, self.odd, self.at_step, self.steps = where, odd, at_step, 0

    def forward(self, x):
        import torch.distributed as dist
        branch = dist.get_rank() == self.odd and self.steps >= self.at_step
        self.steps += 1
        x = self.b(self.a(x).relu())
        if branch and self.where == "forward":
            x = self.extra(x)
        if branch and self.where == "backward":
            x = x.detach()  # no backward through a and b on this rank
        return self.c(x)


def _train(rank: int, world: int, where: str, at_step: int) -> dict:
    import fz3
    model = Branchy(where, world - 1, at_step)
    engine = fz3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            fz3.Config(param_persistence_threshold=0, reduce_bucket_size=300))
    x = torch.ones(2, 16)
    t0 = time.monotonic()
    try:
        for step in range(at_step + 2):
            t0 = time.monotonic()
            engine.backward(engine(x).square().mean())
            engine.step()
    except fz3.DivergenceError as e:
        return {"error": str(e), "step": step, "seconds": time.monotonic() - t0}
    return {"error": None, "step": step}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("at_step", [0, 2])
def test_every_rank_raises_instead_of_hanging(world, where, at_step):
    t0 = time.monotonic()
    outs = launch.run(_train, world_size=world, args=(where, at_step), timeout=200)
    assert time.monotonic() - t0 < 120
    for rank, out in enumerate(outs):
        assert out["error"] is not None, f"rank {rank} trained on: {out}"
        assert out["step"] == at_step and out["seconds"] < 30, out
        msg = out["error"]
        assert "ranks diverged" in msg and "before any data of this collective was received" in msg, msg
        for r in range(world):
            assert f"rank {r}: step {at_step + 1}, collective" in msg, msg
        assert "module '" in msg, msg


def test_the_message_names_what_each_rank_was_about_to_gather():
    """Rank 1 runs `extra` after b; rank 0 goes on to c."""
    for out in launch.run(_train, world_size=2, args=("forward", 0), timeout=200):
        msg = out["error"]
        assert "rank 0: step 1, collective 3: all-gather of 2 params ('c.weight' .. 'c.bias', 272 elements) " \
               "of module 'c'" in msg, msg
        assert "rank 1: step 1, collective 3: all-gather of 2 params ('extra.weight' .. 'extra.bias', 272 " \
               "elements) of module 'extra'" in msg, msg


def _same(rank: int, world: int) -> dict:
    import fz3
    model = Branchy("forward", -1, 0)  # no rank branches
    engine = fz3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            fz3.Config(param_persistence_threshold=0, reduce_bucket_size=300))
    for _ in range(3):
        engine.backward(engine(torch.ones(2, 16)).square().mean())
        engine.step()
    return {"agreement": engine.interp.agreement is not None, "step": engine.interp.agreement.step}


def test_ranks_that_agree_train_on_with_the_check_on():
    for out in launch.run(_same, world_size=3, timeout=200):
        assert out == {"agreement": True, "step": 3}


def _exchange(rank: int, world: int, mine: int) -> dict:
    """Rank r posts the descriptor of a gather of param `mine * r` (the ranks differ when `mine`
    is 1 and agree when it is 0) and sends its data to the peer under the descriptor's tag."""
    from fz3 import DivergenceError
    from fz3.interpreters import agreement, threads
    from fz3.interpreters.transport import TorchTransport
    comm = threads.current() or TorchTransport()
    ag = agreement.Agreement.for_transport(comm, lambda v: str(v))
    posted = ag.post(agreement.GATHER, (mine * rank,), 4)
    got = torch.full((4,), -1.0)
    peer = 1 - rank
    recv = comm.irecv(got, peer, posted.tag)
    send = comm.isend(torch.full((4,), float(rank)), peer, posted.tag)
    work = ag.guard(posted, recv)
    try:
        work.wait()
    except DivergenceError as e:
        if threads.current() is None:
            time.sleep(1.0)  # the peer's data had every chance to arrive
        return {"error": str(e), "received": recv.is_completed(), "got": got.tolist(), "norm": None}
    send.wait()
    norm = ag.all_reduce_sum(torch.tensor([0.1 + rank], dtype=torch.float64))
    return {"error": None, "received": True, "got": got.tolist(), "norm": norm.item()}


RUNNERS = {"processes": lambda fn, args: launch.run(fn, world_size=2, args=args, timeout=120),
           "threads": lambda fn, args: launch.run_threads(fn, 2, args)}


@pytest.mark.parametrize("runner", sorted(RUNNERS))
def test_data_posted_under_a_mismatched_descriptor_is_never_received(runner):
    """[Note: descriptors beside the data] the data travels under a tag made from the descriptor:
    ranks at different collectives post different tags, so nothing of the other's arrives."""
    for rank, out in enumerate(RUNNERS[runner](_exchange, (1,))):
        assert out["error"] is not None and "ranks diverged" in out["error"], out
        assert not out["received"] and out["got"] == [-1.0] * 4, out


@pytest.mark.parametrize("runner", sorted(RUNNERS))
def test_agreeing_ranks_exchange_their_data_and_sum_the_norm_in_rank_order(runner):
    for rank, out in enumerate(RUNNERS[runner](_exchange, (0,))):
        assert out["error"] is None and out["got"] == [float(1 - rank)] * 4, out
        assert out["norm"] == 0.1 + 1.1  # the same bits on every rank: rank 0's value plus rank 1's
