"""N ranks as threads of one process (fz3/interpreters/threads.py): the transport keeps gloo's
semantics, and the real engine and interpreter run on it exactly as on gloo processes.

    transport   point-to-point messages match per tag in posting order; collectives sum in rank
                order; ranks calling different collectives fail; a world where no rank can go on
                is reported at once, naming what each waits for; a rank that raises is named;
                private_rng gives each rank a generator stream of its own
    engine      the parity models (tests/support/parity.py) trained on 2 thread ranks give the same
                losses and params, bit for bit, as on 2 gloo processes; divergence is
                caught there too
"""
from __future__ import annotations

import pytest
import torch

from fz3 import launch
from fz3.shell.compiled import PROCESS_WIDE
from fz3.interpreters import threads

pytestmark = pytest.mark.timeout(600)


def _messages(rank: int, world: int) -> list:
    t = threads.current()
    peer = 1 - rank
    if rank == 0:
        works = [t.isend(torch.tensor([float(i)]), peer, tag=7) for i in range(3)]
        works.append(t.isend(torch.tensor([9.0]), peer, tag=8))
        return []
    bufs = [torch.zeros(1) for _ in range(4)]
    works = [t.irecv(bufs[0], peer, 7), t.irecv(bufs[1], peer, 7), t.irecv(bufs[3], peer, 8),
             t.irecv(bufs[2], peer, 7)]
    for w in reversed(works):  # waited in another order than posted: matching is by posting order
        w.wait()
    return [b.item() for b in bufs]


def test_messages_match_per_tag_in_the_order_they_were_posted():
    assert launch.run_threads(_messages, 2) == [[], [0.0, 1.0, 2.0, 9.0]]


def _collectives(rank: int, world: int) -> dict:
    t = threads.current()
    x = torch.tensor([0.1 * (rank + 1)], dtype=torch.float64)
    t.all_reduce(x)
    out = torch.empty(2 * world)
    t.all_gather_into(out, torch.tensor([rank, rank + 0.5]))
    part = torch.empty(1)
    t.reduce_scatter_into(part, torch.arange(world, dtype=torch.float32) + rank)
    b = torch.tensor([float(rank)])
    t.broadcast(b, src=world - 1)
    return {"sum": x.item(), "gather": out.tolist(), "part": part.item(), "b": b.item()}


def test_collectives_sum_in_rank_order_and_every_rank_gets_the_same_bits():
    outs = launch.run_threads(_collectives, 3)
    for r, out in enumerate(outs):
        assert out["sum"] == (0.1 + 0.2) + 0.30000000000000004  # rank 0 + rank 1, then + rank 2
        assert out["gather"] == [0, 0.5, 1, 1.5, 2, 2.5]
        assert out["part"] == 3 * r + 3  # sum over ranks q of (r + q)
        assert out["b"] == 2.0


def _mismatch(rank: int, world: int) -> None:
    t = threads.current()
    if rank == 0:
        t.all_reduce(torch.zeros(2))
    else:
        t.all_gather_into(torch.empty(2 * world), torch.zeros(2))


def test_ranks_calling_different_collectives_fail():
    with pytest.raises(RuntimeError, match="ranks issued different collectives as their call 1"):
        launch.run_threads(_mismatch, 2)


def _stuck(rank: int, world: int) -> None:
    t = threads.current()
    if rank == 0:
        t.irecv(torch.zeros(1), 1, tag=3).wait()  # rank 1 never sends


def test_a_world_where_no_rank_can_go_on_is_reported_at_once():
    with pytest.raises(RuntimeError, match=r"rank 0 raised WorldFailed.*no rank can go on: rank 0 waits for a "
                                           r"message from rank 1 \(tag 3\); ranks \[1\] returned"):
        launch.run_threads(_stuck, 2, timeout_s=60)


def _raises(rank: int, world: int) -> None:
    t = threads.current()
    if rank == 2:
        raise ValueError("rank two's own error")
    t.all_reduce(torch.zeros(1))


def test_the_rank_that_raised_is_named_not_the_ones_it_stopped():
    with pytest.raises(RuntimeError, match="rank 2 raised ValueError: rank two's own error"):
        launch.run_threads(_raises, 3)


def _draws(rank: int, world: int) -> list:
    """Draw, wait for the others in a collective (the turn passes), draw again."""
    first = torch.rand(2).tolist()
    threads.current().all_reduce(torch.zeros(1))
    return first + torch.rand(2).tolist()


def test_private_rng_gives_each_rank_its_own_stream_and_keeps_the_callers():
    torch.manual_seed(5)
    alone = torch.rand(4).tolist()  # one stream from seed 5, drawn without interruption
    torch.manual_seed(5)
    before = torch.get_rng_state()
    outs = launch.run_threads(_draws, 3, private_rng=True)
    assert outs == [alone] * 3  # each rank's stream starts from the caller's state, others draw between
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(5)
    shared = launch.run_threads(_draws, 3)  # the default: one stream, the ranks' draws interleave
    assert shared[0][:2] == alone[:2] and shared[1] != alone


# ---- the engine ---------------------------------------------------------------------------------

MODELS = ("gpt", "albert", "branch", "checkpoint")  # shared params, a branch, activation checkpointing


def test_the_engine_on_thread_ranks_equals_the_engine_on_gloo_processes():
    """Same engine, same interpreter, same arithmetic (sums in rank order): every rank's loss at
    every micro-step and every consolidated param equal, bit for bit, under every named config."""
    from tests.support import parity
    from test_parity import world  # the parity suite's own 2-process launch, run once per session
    on_threads = parity.run_world(2, MODELS, probes=False, threads=True)
    on_processes = world(2)
    keys = [k for k in on_processes if isinstance(k, tuple) and len(k) == 2 and k[0] in MODELS]
    assert len(keys) >= 3 * len(MODELS), keys
    for k in keys:
        a, b = on_threads[k], on_processes[k]
        assert a.error is None and b.error is None, (k, a.error, b.error)
        assert on_threads["rank_losses"][k] == on_processes["rank_losses"][k], k
        assert a.state.keys() == b.state.keys(), k
        for name in a.state:
            assert torch.equal(a.state[name], b.state[name]), (k, name)
        # RSS: one process holds every thread rank; the compiler's counts are the process's.
        # pool_bytes is a cache that timing decides: gloo's worker thread lets go of a finished
        # all-reduce a moment after waking the wait, so the end of a backward can find one of its
        # buffers still in use and keep it (CI once saw 2020 bytes on processes, 1360 on threads).
        process_wide = {"device_peak_bytes", "device_allocated_bytes", "pool_bytes", *PROCESS_WIDE}
        same = [s for s in b.stats if s not in process_wide]
        assert {s: a.stats[s] for s in same} == {s: b.stats[s] for s in same}, k


class _Branchy(torch.nn.Module):
    """`extra` runs on the rank whose `odd` is set, from step `at` on."""

    def __init__(self, odd: bool, at: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.extra, self.c = (torch.nn.Linear(8, 8) for _ in range(3))
        self.odd, self.at, self.steps = odd, at, 0

    def runs_extra(self) -> bool:
        return self.odd and self.steps >= self.at

    def forward(self, x):
        x = self.a(x)
        if self.runs_extra():
            x = self.extra(x)
        self.steps += 1
        return self.c(x)


class _Skips(_Branchy):
    """`extra` runs on every rank at the first step, then only on the rank whose `odd` is set."""

    def runs_extra(self) -> bool:
        return self.steps == 0 or self.odd


def _until_divergence(model: torch.nn.Module, config) -> dict:
    """Three steps, or the step whose DivergenceError stopped them."""
    import fz3
    engine = fz3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    try:
        for step in range(3):
            engine.backward(engine(torch.ones(2, 8)).sum())
            engine.step()
    except fz3.DivergenceError as e:
        return {"error": str(e), "step": step}
    return {"error": None}


def _diverging(rank: int, world: int) -> dict:
    import fz3
    return _until_divergence(_Branchy(rank == world - 1, at=1), fz3.Config(param_persistence_threshold=0))


@pytest.mark.parametrize("world", [2, 3])
def test_diverging_thread_ranks_raise_divergence_error(world):
    for out in launch.run_threads(_diverging, world):
        assert out["error"] is not None and out["step"] == 1, out
        assert "ranks diverged" in out["error"] and "'extra.weight'" in out["error"], out


def _skipping(rank: int, world: int) -> dict:
    import fz3
    return _until_divergence(_Skips(rank == world - 1, at=0), fz3.Config())


def test_a_branch_of_persistent_params_on_one_rank_raises_divergence_error():
    """Every param persistent (gathered once, at the first step, where every rank runs `extra`),
    every module but the root inert: from the second step no gather tells the ranks apart, and
    the grads come in at the end of backward ([Note: persistent grads at the end of backward]);
    the one rank's grads for `extra` are still a reduce the other does not issue."""
    for out in launch.run_threads(_skipping, 2):
        assert out["error"] is not None and out["step"] == 1, out
        assert "ranks diverged" in out["error"], out
        assert "reduce of 4 params" in out["error"] and "reduce of 6 params" in out["error"], out
