"""A simulated world shadowing the real interpreter of every thread rank (issue #14, point 1).

    shadow = Shadow(world_size)
    def train(rank, world):                  # fz3.launch.run_threads(train, world)
        engine = fz3.initialize(...)
        shadow.attach(engine)                # before its first effect
        ...                                  # train as usual
    shadow.finish()                          # every rank ran the same effects, all checked

The real engine drives the real core; `attach` wraps its interpreter's `run`, so every effect
batch the engine hands to the DistInterpreter also goes, effect by effect, to one
SimulatedWorld (fz3/interpreters/simulated.py) shared by all ranks:

    rank r, effect k:  grads it reads -> real interpreter runs it -> what it shows -> submit(r, k)
                       (param.grad of a      (carriers, pool,        full params gathered now;
                        CopyToBucket,         deferred writes)        grad partitions written
                        HoldGrad or non-                              this window, when no
                        contiguous reduce)                            reduce is in flight)
    shadow, effect k:  once all W ranks submitted it (the last one runs it, so no rank waits):
                       rank r's effect == the first submitter's (I6), accumulate_grad of the
                       W ranks' grads, SimulatedWorld.run([effect]), then every rank's real
                       full params and partitions == the shadow's, bit for bit

After the optimizer step the real shards change (the optimizer on the masters, then
`store.refresh_shards`): the wrapped refresh submits the new shards as a pseudo-effect,
`NewShards`, at the same stream position on every rank, and the shadow takes them (and writes
each into its full value where the real shard is a slice of it: a kept param's). The shadow
checks the collectives and the writes, not the optimizer.

Bitwise equality needs every reduce to give the same bits in any order of summation: the
shadow sums over ranks with torch.sum, the thread transport rank after rank, p2p its own
partition first. `setups()` in tests/support/shadowed.py keeps to cases where that holds ([Note: exact reduces]).
A mismatch raises `Mismatch` in the rank that completed the effect; `run_differential`
(tests/support/shadowed.py) re-raises it, naming the effect, its index, the rank and the param.
"""
from __future__ import annotations

import threading
from typing import NamedTuple, Optional

import torch

from fz3.core.effects import (CopyToBucket, FreePartitions, HoldGrad, ReduceBucket, WritePartition,
                              ZeroPartitions, record)
from fz3.interpreters.simulated import SimulatedWorld, SimulationError

BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


class Mismatch(AssertionError):
    """The real interpreter and the shadow disagree (or the ranks' effect streams do)."""


@record  # compared by type too: NewShards is not a WaitReduce (both empty tuples)
class NewShards(NamedTuple):
    """Pseudo-effect: the optimizer step gave the ranks new shards (never reaches an interpreter)."""


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bits, but for the sign of a zero (NaN == the same NaN).

    [Note: signed zeros] The shadow's reduce is torch.sum over ranks, which starts from +0.0:
    the sum of -0.0 on every rank is +0.0 there, and -0.0 on gloo and the thread transport
    (which add the ranks' values to the first one's) and in the p2p carrier (which adds the
    peers' to its own). A grad of -0.0 is common (relu's zero times a negative weight), so the
    sign of a zero is not compared: `+ 0.0` maps -0.0 to +0.0 and leaves every other value's bits.
    """
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal((a + 0.0).contiguous().view(BITS[a.dtype]), (b + 0.0).contiguous().view(BITS[b.dtype]))


class Shadow:
    """One SimulatedWorld run on the effect stream of W real thread ranks, and compared to them."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.lock = threading.Lock()
        self.engines: dict[int, object] = {}
        self.initial: dict[int, list[torch.Tensor]] = {}  # rank -> its shards at attach
        self.sim: Optional[SimulatedWorld] = None
        self.position = [0] * world_size  # effects each rank submitted
        self.pending: dict[int, tuple[object, int, dict]] = {}  # k -> (effect, first rank, rank -> seen)
        self.done = 0  # effects the shadow ran
        self.compared = {"full": 0, "partition": 0}  # tensors compared
        self.failure: Optional[Mismatch] = None

    # ---- the ranks' side ------------------------------------------------------------------------

    def attach(self, engine) -> None:
        """Send every effect `engine` runs, and its shard refreshes, through the shadow."""
        r, store, interp = engine.rank, engine.store, engine.interp
        with self.lock:
            self.engines[r] = engine
            self.initial[r] = [s.detach().clone() for s in store.shards]
        real_run, real_refresh, written = interp.run, store.refresh_shards, set()

        def run(effects) -> None:
            for e in effects:
                grads = grads_read(store, e)
                self._check_grads(r, e, grads)
                real_run((e,))
                if isinstance(e, WritePartition):
                    written.add(e.param)
                elif isinstance(e, ZeroPartitions):
                    written.update(p for p in e.params if store.partitions[p] is not None)
                elif isinstance(e, FreePartitions):
                    written.clear()
                full = {p: store.params[p].detach().reshape(-1).clone()
                        for p, f in enumerate(store.full) if f is not None}
                # partitions are settled when no reduce is in flight (its writes wait for it)
                parts = None if interp.reduces else {p: store.partitions[p].clone() for p in written}
                self.submit(r, e, grads=grads, full=full, parts=parts)

        def refresh() -> None:
            real_refresh()
            self.submit(r, NewShards(), shards=[s.detach().clone() for s in store.shards],
                        in_full={p: at[1] for p, at in enumerate(map(store.full_of, store.shards)) if at})

        interp.run, store.refresh_shards = run, refresh

    def submit(self, rank: int, e: object, **seen) -> None:
        with self.lock:
            if self.failure is not None:
                raise self.failure
            k = self.position[rank]
            self.position[rank] += 1
            first, _, ranks = self.pending.setdefault(k, (e, rank, {}))
            if e != first:
                self._fail(f"I6: effect {k} of rank {rank} is {e}, rank {self.pending[k][1]}'s is {first}")
            ranks[rank] = seen
            if len(ranks) == self.world_size:
                del self.pending[k]
                self._run(k, e, [ranks[r] for r in range(self.world_size)])

    def _check_grads(self, rank: int, e: object, grads: dict[int, torch.Tensor]) -> None:
        """A grad an effect reads has its param's numel (else the shell placed a wrong one)."""
        spec, names = self.engines[rank].spec, self.engines[rank].tables.names
        for p, g in grads.items():
            if g.numel() != spec.params[p].numel:
                with self.lock:
                    self._fail(f"rank {rank}, effect {self.position[rank]} {e}: param.grad of param {p} "
                               f"({names[p]}) has {g.numel()} elements, the param {spec.params[p].numel}")

    # ---- the shadow's side ---------------------------------------------------------------------

    def _world(self) -> SimulatedWorld:
        if self.sim is None:  # every rank attached before it submitted its first effect
            e0 = self.engines[0]
            shards = [self.initial[r] for r in range(self.world_size)]
            self.sim = SimulatedWorld(e0.spec, config=e0.config, shards=shards,
                                      grad_dtypes=[torch.float32] * len(e0.spec.params))
        return self.sim

    def _run(self, k: int, e: object, seen: list[dict]) -> None:
        sim = self._world()
        self.done += 1
        if isinstance(e, NewShards):
            sim.shards = [s["shards"] for s in seen]
            for r, s in enumerate(seen):  # a shard read from its full value wrote it there
                for p, at in s["in_full"].items():  # ([Note: a kept param holds its shard], store.py)
                    full = sim.full[r][p] = sim.full[r][p].clone()
                    full[at:at + sim.shards[r][p].numel()] = sim.shards[r][p]
            return
        if any(s["grads"].keys() != seen[0]["grads"].keys() for s in seen):
            self._fail(f"effect {k} {e}: the ranks had grads for params {[sorted(s['grads']) for s in seen]}")
        for p in seen[0]["grads"]:
            sim.accumulate_grad(p, [s["grads"][p] for s in seen])
        try:
            sim.run([e])
        except SimulationError as err:
            self._fail(f"effect {k} {e}: the simulated world refused it: {err}")
        for r, s in enumerate(seen):
            self._compare(k, e, r, s["full"], sim.full[r], "full")
            if s["parts"] is not None:
                self._compare(k, e, r, s["parts"], {p: sim.partitions[r][p] for p in s["parts"]}, "partition")

    def _compare(self, k: int, e: object, r: int, real: dict, shadow: dict, what: str) -> None:
        names = self.engines[0].tables.names
        if real.keys() != shadow.keys():
            self._fail(f"after effect {k} {e}, rank {r}: real {what} params {sorted(real)}, "
                       f"shadow's {sorted(shadow)}")
        for p, got in real.items():
            self.compared[what] += 1
            if not same_bits(got, shadow[p]):
                self._fail(f"after effect {k} {e}, rank {r}: {what} of param {p} ({names[p]}) differs\n"
                           f" real   {got}\n shadow {shadow[p]}")

    def _fail(self, message: str) -> None:
        self.failure = Mismatch(message)
        raise self.failure

    def finish(self) -> dict:
        """After the run: every rank submitted the same number of effects, all run and checked."""
        if self.failure is not None:
            raise self.failure
        if len(set(self.position)) != 1 or self.pending:
            raise Mismatch(f"effects submitted per rank {self.position}, {len(self.pending)} left unrun")
        return {"effects": self.done, **self.compared}


def grads_read(store, e: object) -> dict[int, torch.Tensor]:
    """The param.grad values effect `e` consumes, read before the real interpreter takes them."""
    if isinstance(e, (CopyToBucket, HoldGrad)):
        ps = (e.param,)
    elif isinstance(e, ReduceBucket) and not e.contiguous:
        ps = tuple(s.param for s in e.slots)
    else:
        return {}
    return {p: store.params[p].grad.detach().clone() for p in ps if store.params[p].grad is not None}
