"""[Note: shared-memory carrier] (fz3/interpreters/shared_memory.py): gloo ranks on one host send the
P2P carrier's large messages through rings in shared memory, small ones over gloo.

The transport on 2 and 3 spawned ranks: messages larger than a ring, of odd sizes, many in flight
each way and mixed with gloo's small ones, arrive exact; a message that is not the one a rank
expects stops that peer's stream with an error naming both, its bytes unread; a peer whose
process exits fails the wait within seconds; ranks that are not on one host (or where one rank
cannot make its rings) all stay on gloo; no ring file is left in /dev/shm. The engine: the same
losses, bit for bit, with the rings as without, the rings carrying the bytes; a rank that runs
an extra module, or exits, is a DivergenceError as on gloo."""
from __future__ import annotations

import functools
import glob
import os
import time

import pytest
import torch
from torch import nn

from fz3 import launch
from fz3.interpreters import shared_memory

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not shared_memory.supported(), reason="x86-64 Linux with /dev/shm only")]

KiB = 1 << 10


def _transport():
    from fz3.interpreters.transport import TorchTransport
    return shared_memory.for_carrier(TorchTransport())


def _exchange(rank: int, world: int) -> dict:
    """Every rank sends every peer messages of these sizes (bytes), posted all at once, each
    filled from (sender, receiver, index): two larger than a ring, odd ones, small ones."""
    sizes = [3 * shared_memory.CAPACITY + 5, 64 * KiB, 12, 200 * KiB + 1, 2 * shared_memory.CAPACITY, 100]
    comm = _transport()
    peers = [j for j in range(world) if j != rank]
    got, works = {}, []
    for j in peers:
        for i, n in enumerate(sizes):
            got[j, i] = torch.empty(n, dtype=torch.uint8)
            works.append(comm.irecv(got[j, i], j, tag=i + 1))
    for j in peers:
        for i, n in enumerate(sizes):
            t = (torch.arange(n, dtype=torch.int64) * (rank + 1) + 7 * j + i).to(torch.uint8)
            works.append(comm.isend(t, j, tag=i + 1))
    for w in works:
        w.wait()
    left = glob.glob(f"/dev/shm/fz3-*-{rank}-*")  # every rank unlinked its rings before it sent
    exact = all(torch.equal(got[j, i], (torch.arange(n, dtype=torch.int64) * (j + 1) + 7 * rank + i).to(torch.uint8))
                for j in peers for i, n in enumerate(sizes))
    return {"kind": type(comm).__name__, "exact": exact, "moved": comm.moved, "left": left}


@pytest.mark.parametrize("world", [2, 3])
def test_messages_of_every_size_arrive_exact_both_ways(world):
    for out in launch.run(_exchange, world_size=world, timeout=120):
        assert out["kind"] == "SharedMemoryTransport" and out["exact"], out
        big = 3 * shared_memory.CAPACITY + 5 + 64 * KiB + 200 * KiB + 1 + 2 * shared_memory.CAPACITY
        assert out["moved"] == (world - 1) * (big + 4 * shared_memory.HEADER), out  # the small ones: gloo
        assert out["left"] == [], out  # the ring files went once both ends had them mapped


def _mismatch(rank: int, world: int) -> dict:
    comm = _transport()
    if rank == 1:
        comm.isend(torch.ones(100 * KiB, dtype=torch.uint8), 0, tag=5).wait()
        return {}
    into = torch.zeros(200 * KiB, dtype=torch.uint8)
    try:
        comm.irecv(into, 1, tag=5).wait()
    except RuntimeError as e:
        return {"error": str(e), "untouched": int(into.sum())}
    return {"error": None}


def test_a_message_that_is_not_the_one_expected_fails_the_wait_its_bytes_unread():
    out = launch.run(_mismatch, world_size=2, timeout=120)[0]
    assert out["error"] is not None and "out of step" in out["error"], out
    assert "rank 1 sent 102,400 bytes under tag 5 where this rank expected 204,800 bytes under tag 5" in out["error"]
    assert out["untouched"] == 0


def _peer_exits(rank: int, world: int) -> dict:
    comm = _transport()
    if rank == 1:
        time.sleep(0.5)
        os._exit(3)
    t0 = time.monotonic()
    try:
        comm.irecv(torch.empty(300 * KiB, dtype=torch.uint8), 1, tag=1).wait()
    except RuntimeError as e:
        return {"error": str(e), "seconds": time.monotonic() - t0}
    return {"error": None}


def test_a_peer_whose_process_exits_fails_the_wait_within_seconds(tmp_path):
    import multiprocessing as mp
    results = mp.get_context("spawn").Queue()
    with pytest.raises(RuntimeError, match="a rank failed"):
        launch.run(_report(_peer_exits, results), world_size=2, timeout=60)
    out = results.get(timeout=5)
    assert out["error"] is not None and "rank 1's process" in out["error"] and "has exited" in out["error"], out
    assert out["seconds"] < 10, out


class _report:
    """fn's result of rank 0, put on a queue (launch.run fails as a whole when a rank exits)."""

    def __init__(self, fn, queue) -> None:
        self.fn, self.queue = fn, queue

    def __call__(self, rank, world):
        out = self.fn(rank, world)
        if rank == 0:
            self.queue.put(out)
        return out


def _fallback(rank: int, world: int, how: str) -> str:
    if how == "hosts" and rank == 1:
        shared_memory._host = lambda: 12345  # as if on another host
    if how == "full" and rank == 1:
        def full(path):
            raise OSError(28, "No space left on device")
        shared_memory.make_ring = full
    comm = _transport()
    t = torch.full((100 * KiB,), float(rank))
    peer = 1 - rank
    got = torch.empty_like(t)
    works = [comm.irecv(got, peer, 1), comm.isend(t, peer, 1)]
    for w in works:
        w.wait()
    assert got[0].item() == peer
    return type(comm).__name__


@pytest.mark.parametrize("how", ["hosts", "full"])
def test_ranks_not_on_one_host_or_without_room_for_rings_all_stay_on_gloo(how):
    assert launch.run(_fallback, world_size=2, args=(how,), timeout=120) == ["TorchTransport"] * 2
    assert not [p for p in glob.glob("/dev/shm/fz3-*") if os.stat(p).st_uid == os.getuid()
                and time.time() - os.stat(p).st_mtime < 60]


class Wide(nn.Module):
    """Params whose shards are 64 KiB or more (the rings carry them) and small ones (gloo)."""

    def __init__(self, extra_on: int = -1, at_step: int = 1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.extra = (nn.Linear(256, 256) for _ in range(3))
        self.head = nn.Linear(256, 4)
        self.extra_on, self.at_step, self.steps = extra_on, at_step, 0

    def forward(self, x):
        import torch.distributed as dist
        x = self.b(self.a(x).relu()).relu()
        if dist.get_rank() == self.extra_on and self.steps >= self.at_step:
            x = self.extra(x)
        self.steps += 1
        return self.head(x)


def _train(rank: int, world: int, shared: bool, extra_on: int = -1, exit_on: int = -1) -> dict:
    import logging

    import fz3
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("fz3").addHandler(handler)
    logging.getLogger("fz3").setLevel(logging.INFO)
    model = Wide(extra_on)
    engine = fz3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                            fz3.Config(reduce_bucket_size=100_000), options=fz3.Options(shared_memory=shared))
    g = torch.Generator().manual_seed(rank)
    losses = []
    t0 = time.monotonic()
    try:
        for step in range(4):
            if rank == exit_on and step == 2:
                os._exit(3)
            t0 = time.monotonic()
            loss = engine(torch.randn(8, 256, generator=g)).square().mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    except fz3.DivergenceError as e:
        return {"error": str(e), "seconds": time.monotonic() - t0}
    comm = engine.interp.gather.ctx.comm
    return {"losses": losses, "kind": type(comm).__name__, "moved": getattr(comm, "moved", 0),
            "said": [m for m in said if m.startswith(f"fz3: {world} ranks")]}


@pytest.mark.parametrize("world", [2, 3])
def test_the_engine_trains_the_same_bits_with_the_rings_carrying_the_bytes(world):
    rings = launch.run(_train, world_size=world, args=(True,), timeout=200)
    tcp = launch.run(_train, world_size=world, args=(False,), timeout=200)
    shard = 256 * 256 * 4 // world  # bytes of a's, b's or extra's shard
    for r, t in zip(rings, tcp):
        assert r["losses"] == t["losses"], (r, t)
        assert r["kind"] == "SharedMemoryTransport" and t["kind"] == "TorchTransport"
        # every step gathers a and b (and extra's, gathered ahead) and reduces their grads
        assert r["moved"] >= 4 * 4 * (world - 1) * shard, r
    said = f"fz3: {world} ranks"
    assert "all-gather by p2p (large messages through shared memory)" in rings[0]["said"][0], rings[0]["said"]
    assert "all-gather by p2p," in tcp[0]["said"][0], tcp[0]["said"]
    assert rings[0]["said"][0].startswith(said)


def test_ranks_that_diverge_raise_divergence_errors_with_the_rings():
    t0 = time.monotonic()
    outs = launch.run(_train, world_size=2, args=(True, 1), timeout=200)
    assert time.monotonic() - t0 < 150
    for rank, out in enumerate(outs):
        assert out.get("error") is not None and "ranks diverged" in out["error"], (rank, out)
        assert out["seconds"] < 30, out


def test_a_peer_that_exits_mid_training_is_named_as_gone_with_the_rings():
    import multiprocessing as mp
    results = mp.get_context("spawn").Queue()
    with pytest.raises(RuntimeError, match="a rank failed"):
        launch.run(_report(functools.partial(_train, shared=True, exit_on=1), results), world_size=2, timeout=120)
    out = results.get(timeout=5)
    assert out.get("error") is not None and "rank 1 exited or closed its connection" in out["error"], out
    assert out["seconds"] < 10, out
