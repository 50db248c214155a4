"""N ranks as threads of one process: the real engine and interpreter, no process group.

    outs = fz3.launch.run_threads(train, world_size=3)   # train(rank, world_size) -> result

Each thread is one rank. Inside it, `fz3.initialize` finds the thread's `ThreadTransport`
(`current()`) instead of torch.distributed, so the same training function runs under
`fz3.launch.run` (processes, gloo) and here, and the same Engine and DistInterpreter run their
effects: point-to-point messages, collectives and the divergence check go through the
transport (fz3/interpreters/transport.py), whose messages are handed over in memory. This is
the simulated world at the engine's level: engine-level tests (and Hypothesis properties) run N
ranks without launching processes. (fz3/interpreters/simulated.py is the simulated world below
the engine: one effect stream applied to N ranks' bare tensors, for the core's machines.)

The ranks take turns, one at a time, in rank order: a rank runs until it must wait for another
(a receive whose message is not there, a collective not every rank has called), then hands the
turn to the next rank that can go on. So a run is deterministic, the same interleaving every
time (Hypothesis can shrink what it finds), code outside fz3 that uses the process-wide RNG
(model construction under torch.manual_seed) draws the same numbers as on separate processes,
and a world where no rank can go on is reported at once, naming what each rank waits for,
instead of hanging until a timeout.

Semantics kept from gloo: messages between two ranks under one tag match in the order they were
posted; a collective is the k-th collective call of every rank, and ranks that call different
ones (kind or size) fail; every reduction is a SUM, added in rank order, so every rank gets the
same bits. A send copies its tensor when posted (gloo reads it later; a program that changes a
buffer before its send completes is wrong on gloo and not caught here). A rank that raises
fails the world: every other rank's wait raises WorldFailed at once instead of hanging (the
divergence check names it as that rank's leaving: its fz3.DivergenceError comes from the
WorldFailed), and run_threads returns each rank's result or re-raises the first error, naming
its rank. A wait never times out: no rank can go on is found at once, and a rank stuck in code
of its own holds the turn until run_threads' `timeout_s`, the world's `timeout()`.

[Note: a private RNG per rank] The ranks share the process's CPU generator, so a rank's dropout
masks depend on what the other ranks drew while it waited. `run_threads(..., private_rng=True)`
gives each rank a stream of its own, as a process rank has: a rank saves the generator's state
when it hands the turn on and restores its own when it gets the turn back (the ranks take turns,
so one generator serves them all). Every stream starts from the caller's state, and the caller's
state is restored when the run ends. fz3.check uses it to seed rank r's micro-step i alike on the
thread ranks and in its one-process reference.
"""
from __future__ import annotations

import datetime
import threading
import time
from collections import Counter
from typing import Any, Callable, Optional

import torch

_LOCAL = threading.local()


def current() -> Optional["ThreadTransport"]:
    """The transport of the rank this thread runs (inside run_threads), else None."""
    return getattr(_LOCAL, "transport", None)


class WorldFailed(RuntimeError):
    """Another rank of the thread world raised; this rank stops waiting for it."""


class ThreadWorld:
    """What the ranks share: posted messages and collective calls, and whose turn it is."""

    def __init__(self, world_size: int, timeout_s: float = 600.0, private_rng: bool = False) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size, self.timeout_s = world_size, timeout_s
        # [Note: a private RNG per rank]: rank -> its CPU generator state while another rank runs
        self.rng: Optional[dict[int, torch.Tensor]] = None
        if private_rng:
            start = torch.get_rng_state()
            self.rng = {r: start for r in range(world_size)}
        self.cv = threading.Condition()
        self.messages: dict[tuple, torch.Tensor] = {}  # (src, dst, tag, k) -> a copy of what was sent
        self.sends: Counter = Counter()  # (src, dst, tag) -> sends posted
        self.recvs: Counter = Counter()  # (src, dst, tag) -> receives posted
        self.calls: dict[int, dict[int, tuple]] = {}  # k -> rank -> (kind, input copy)
        self.taken: Counter = Counter()  # k -> ranks that took their result
        self.turn: Optional[int] = 0  # the rank that runs
        self.waiting: dict[int, tuple[Callable[[], bool], str]] = {}  # rank -> (can it go on, what it waits for)
        self.finished: set[int] = set()
        self.failed: Optional[str] = None

    def fail(self, why: str) -> None:
        with self.cv:
            if self.failed is None:
                self.failed = why
            self.cv.notify_all()

    def start(self, rank: int) -> None:
        with self.cv:
            self.cv.wait_for(lambda: self.turn == rank or self.failed is not None)
            self._take_rng(rank)

    def finish(self, rank: int) -> None:
        with self.cv:
            self.finished.add(rank)
            if self.turn == rank:
                self._pass_turn(rank)
            self.cv.notify_all()

    def wait_for(self, rank: int, ready: Callable[[], bool], what: str) -> None:
        """Called by `rank`, holding the condition: return once `ready()`, letting the other ranks
        run meanwhile; WorldFailed if the world failed or no rank can go on."""
        if ready():
            return
        self.waiting[rank] = (ready, what)
        if self.rng is not None:
            self.rng[rank] = torch.get_rng_state()
        self._pass_turn(rank)
        self.cv.wait_for(lambda: self.turn == rank or self.failed is not None)
        self._take_rng(rank)
        del self.waiting[rank]
        if not ready():
            raise WorldFailed(f"thread world: rank {rank} {what}, abandoned: {self.failed}")

    def _take_rng(self, rank: int) -> None:
        """The rank that got the turn draws from its own stream ([Note: a private RNG per rank])."""
        if self.rng is not None:
            torch.set_rng_state(self.rng[rank])

    def _pass_turn(self, me: int) -> None:
        """The next rank after `me`, in rank order, that can go on runs; if none can, the world
        has failed (a deadlock: every unfinished rank waits for another)."""
        for d in range(1, self.world_size + 1):
            r = (me + d) % self.world_size
            if r in self.finished:
                continue
            if r not in self.waiting or self.waiting[r][0]():
                self.turn = r
                self.cv.notify_all()
                return
        self.turn = None
        if len(self.finished) < self.world_size and self.failed is None:
            stuck = "; ".join(f"rank {r} {what}" for r, (_, what) in sorted(self.waiting.items()))
            done = sorted(self.finished)
            self.failed = f"no rank can go on: {stuck}" + (f"; ranks {done} returned" if done else "")
        self.cv.notify_all()


class _Done:
    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _Recv:
    def __init__(self, world: ThreadWorld, key: tuple, out: torch.Tensor) -> None:
        self.world, self.key, self.out, self.done = world, key, out, False

    def is_completed(self) -> bool:
        with self.world.cv:
            return self.done or self.key in self.world.messages

    def wait(self, timeout=None) -> bool:
        if self.done:
            return True
        w = self.world
        with w.cv:
            w.wait_for(self.key[1], lambda: self.key in w.messages,
                       f"waits for a message from rank {self.key[0]} (tag {self.key[2]})")
            got = w.messages.pop(self.key)
        if got.shape != self.out.shape:
            raise RuntimeError(f"thread world: rank {self.key[1]} posted a receive of {tuple(self.out.shape)} "
                               f"from rank {self.key[0]}, which sent {tuple(got.shape)} (tag {self.key[2]})")
        self.out.copy_(got)
        self.done = True
        return True


class _Collective:
    def __init__(self, transport: "ThreadTransport", k: int, finish: Callable[[list], None], what: str) -> None:
        self.transport, self.k, self.finish, self.what, self.done = transport, k, finish, what, False

    def is_completed(self) -> bool:
        w = self.transport.world
        with w.cv:
            return self.done or len(w.calls.get(self.k, {})) == w.world_size

    def wait(self, timeout=None) -> bool:
        if self.done:
            return True
        t, w = self.transport, self.transport.world
        with w.cv:
            w.wait_for(t.rank, lambda: len(w.calls[self.k]) == w.world_size,
                       f"waits in its collective call {self.k + 1} ({self.what})")
            calls = w.calls[self.k]
            kinds = {r: c[0] for r, c in calls.items()}
            if len(set(kinds.values())) > 1:
                raise RuntimeError(f"thread world: ranks issued different collectives as their call "
                                   f"{self.k + 1}: {dict(sorted(kinds.items()))}")
            inputs = [calls[r][1] for r in range(w.world_size)]
            w.taken[self.k] += 1
            if w.taken[self.k] == w.world_size:
                del w.calls[self.k], w.taken[self.k]
        self.finish(inputs)
        self.done = True
        return True


class ThreadTransport:
    """One rank's end of a ThreadWorld (fz3/interpreters/transport.py's interface)."""

    backend = "threads"

    def __init__(self, world: ThreadWorld, rank: int) -> None:
        self.world, self.rank, self.world_size = world, rank, world.world_size
        self.collectives = 0  # collective calls so far

    def isend(self, t: torch.Tensor, dst: int, tag: int):
        w, key = self.world, (self.rank, dst, tag)
        with w.cv:
            w.messages[(*key, w.sends[key])] = t.detach().clone()
            w.sends[key] += 1
            w.cv.notify_all()
        return _Done()

    def irecv(self, t: torch.Tensor, src: int, tag: int):
        w, key = self.world, (src, self.rank, tag)
        with w.cv:
            k = w.recvs[key]
            w.recvs[key] += 1
        return _Recv(w, (*key, k), t)

    def _call(self, kind: str, inp: torch.Tensor, finish: Callable[[list], None], async_op: bool):
        w, k = self.world, self.collectives
        self.collectives += 1
        with w.cv:
            w.calls.setdefault(k, {})[self.rank] = (kind, inp.detach().clone())
            w.cv.notify_all()
        work = _Collective(self, k, finish, kind)
        if async_op:
            return work
        work.wait()
        return None

    def all_reduce(self, t: torch.Tensor, async_op: bool = False):
        return self._call(f"all_reduce {tuple(t.shape)} {t.dtype}", t, lambda xs: t.copy_(_sum(xs)), async_op)

    def all_gather_into(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
        return self._call(f"all_gather {tuple(inp.shape)} {inp.dtype}", inp,
                          lambda xs: out.copy_(torch.cat([x.reshape(-1) for x in xs])), async_op)

    def reduce_scatter_into(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
        n = out.numel()
        return self._call(f"reduce_scatter {tuple(inp.shape)} {inp.dtype}", inp,
                          lambda xs: out.copy_(_sum(xs).reshape(-1)[self.rank * n:(self.rank + 1) * n]), async_op)

    def broadcast(self, t: torch.Tensor, src: int = 0):
        return self._call(f"broadcast {tuple(t.shape)} {t.dtype} from {src}", t, lambda xs: t.copy_(xs[src]), False)

    def side(self) -> "ThreadTransport":
        return self

    def timeout(self) -> datetime.timedelta:
        """run_threads' timeout_s: its waits never time out themselves (module docstring)."""
        return datetime.timedelta(seconds=self.world.timeout_s)


def _stopped_by_another(e: BaseException | None) -> bool:
    """Whether `e` is, or was raised from, a WorldFailed: this rank only stopped because another
    failed (e.g. the divergence check's fz3.DivergenceError naming the rank that left)."""
    while e is not None:
        if isinstance(e, WorldFailed):
            return True
        e = e.__cause__ or e.__context__
    return False


def _sum(xs: list) -> torch.Tensor:
    total = xs[0].clone()
    for x in xs[1:]:
        total += x
    return total


def run_threads(fn: Callable[..., Any], world_size: int, args: tuple = (), *, timeout_s: float = 600.0,
                threads: int = 1, private_rng: bool = False) -> list:
    """fn(rank, world_size, *args) on `world_size` threads, each a rank of one ThreadWorld;
    -> [result of rank 0, ...]. The first error a rank raised is re-raised, naming the rank
    (a rank that only stopped because another failed is not the first); a run past `timeout_s`
    raises TimeoutError. torch's intra-op threads are set to `threads` meanwhile, as
    fz3.launch.run sets each rank's (the blocking of a CPU matmul, so its last bits, depends on
    them: with the same count, a thread rank computes what a process rank does, bit for bit).
    `private_rng`: each rank draws from a CPU generator stream of its own, each starting from
    the caller's state, which is restored at the end ([Note: a private RNG per rank])."""
    caller_rng = torch.get_rng_state() if private_rng else None
    world = ThreadWorld(world_size, timeout_s, private_rng)
    results: list = [None] * world_size
    errors: dict[int, BaseException] = {}

    def rank_main(rank: int) -> None:
        _LOCAL.transport = ThreadTransport(world, rank)
        try:
            world.start(rank)
            if world.failed is None:
                results[rank] = fn(rank, world_size, *args)
        except BaseException as e:  # noqa: BLE001 - reported below, with its rank
            errors[rank] = e
            world.fail(f"rank {rank} raised {type(e).__name__}: {e}")
        finally:
            _LOCAL.transport = None
            world.finish(rank)

    ranks = [threading.Thread(target=rank_main, args=(r,), name=f"fz3-rank-{r}", daemon=True)
             for r in range(world_size)]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for t in ranks:
            t.start()
        deadline = time.monotonic() + timeout_s
        for t in ranks:
            t.join(max(0.0, deadline - time.monotonic()))
    finally:
        torch.set_num_threads(before)
        if caller_rng is not None:
            torch.set_rng_state(caller_rng)
    running = [r for r, t in enumerate(ranks) if t.is_alive()]
    if running:
        world.fail(f"fz3.launch.run_threads: past {timeout_s:.0f} s")
        raise TimeoutError(f"fz3.launch.run_threads: ranks {running} still running after {timeout_s:.0f} s")
    if errors:
        first = min((r for r in errors if not _stopped_by_another(errors[r])), default=min(errors))
        raise RuntimeError(f"fz3.launch.run_threads: rank {first} raised "
                           f"{type(errors[first]).__name__}: {errors[first]}") from errors[first]
    return results
