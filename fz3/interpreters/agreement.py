"""Ranks agree on each collective before any data moves; ranks that diverge raise
DivergenceError instead of hanging.

ZeRO-3 is SPMD: every rank must issue the same collectives in the same order. If their control
flow diverges (data-dependent branches, a rank skipping a block), DeepSpeed and FSDP exchange
data meant for different collectives, or hang until the process group's timeout (30 minutes by
default). fz3 checks instead.

Before each collective of the interpreter (all-gather, reduce, the grad norm's all-reduce), every
rank sends the others a descriptor of it, eight integers:

    kind, optimizer step, collective number in that step, params, first and last ParamId,
    a hash of the ParamIds, elements

It then compares what it receives with its own. The exchange goes over a gloo side group
created at initialize, as point-to-point messages: the k-th descriptor of one rank always pairs
with the k-th of every other. So a rank that runs an extra module, skips one, or runs a backward
the others do not is caught at the first collective where the descriptors differ. Every rank then
raises DivergenceError, naming each rank's step, collective and params (and the module that owns
them), before the collective's data is posted. Native collectives and the grad norm's
all-reduce wait for the descriptors when they are issued. Point-to-point ones post their data
once the descriptors have arrived and matched, which the interpreter looks at on each of its
entries ([Note: agreement off the critical path], `Agreement.defer`).

A rank that issues no collective at all (it left the training loop, or blocks in code of its
own) is reported once the others have waited `FZ3_DIVERGENCE_TIMEOUT` seconds (default: torch's
process-group default, 30 minutes, so that a slow rank is never mistaken for a diverged one). The
check is always on (bench/divergence_overhead.py measures it). FZ3_DIVERGENCE_CHECK=0 turns it
off, for that measurement.
"""
from __future__ import annotations

import datetime
import os
import time
from collections import deque
from typing import Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist

GATHER, REDUCE, NORM = 1, 2, 3
KINDS = {GATHER: "all-gather", REDUCE: "reduce", NORM: "grad-norm all-reduce"}
FIELDS = 8
MOD = (1 << 61) - 1


class DivergenceError(RuntimeError):
    """Ranks issued different collectives: a different module order, different params, or one
    rank stopped issuing them. Raised on every rank, before any data of the mismatched
    collective moves; the message gives each rank's position."""


def enabled() -> bool:
    return os.environ.get("FZ3_DIVERGENCE_CHECK", "1") != "0"


def timeout_s() -> float:
    value = os.environ.get("FZ3_DIVERGENCE_TIMEOUT")
    if value is None:
        return dist.default_pg_timeout.total_seconds()
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if seconds <= 0:
        raise ValueError(f"FZ3_DIVERGENCE_TIMEOUT={value!r}: give seconds, a number > 0")
    return seconds


class Agreement:
    """One rank's side of the descriptor exchange."""

    def __init__(self, group, rank: int, world_size: int,
                 describe: Callable[[Sequence[int]], str]) -> None:
        self.group, self.rank, self.world_size, self.describe = group, rank, world_size, describe
        self.peers = [j for j in range(world_size) if j != rank]
        self.timeout = datetime.timedelta(seconds=timeout_s())
        self.step = 0  # optimizer steps so far
        self.seq = 0  # collectives in this step
        self.checks = 0  # collectives checked in all
        self.failed: DivergenceError | None = None  # once raised, every later collective raises it
        self.deferred: "deque[Deferred]" = deque()  # posted descriptors, data not yet posted
        self.seconds = 0.0  # spent checking (bench/divergence_overhead.py reports it)

    @classmethod
    def for_group(cls, group, rank: int, world_size: int,
                  describe: Callable[[Sequence[int]], str]) -> "Agreement | None":
        """The check for `group` (None: the default group); None when off or alone. Every rank
        must call it (it creates the side group)."""
        if world_size < 2 or not enabled():
            return None
        if group is None:
            side = dist.new_group(backend="gloo")
        else:  # only the group's ranks call this
            side = dist.new_group(ranks=dist.get_process_group_ranks(group), backend="gloo",
                                  use_local_synchronization=True)
        return cls(side, rank, world_size, describe)

    def next_step(self) -> None:
        self.step += 1
        self.seq = 0

    def check(self, kind: int, params: Sequence[int], numel: int) -> None:
        """Raise DivergenceError unless every rank is about to run this same collective."""
        self.resolve(self.post(kind, params, numel))

    def post(self, kind: int, params: Sequence[int], numel: int) -> "Posted":
        """Send this collective's descriptor to every peer and post the receives of theirs;
        `resolve` compares them. Between the two, nothing of the collective may be posted."""
        if self.failed is not None:
            raise self.failed
        start = time.perf_counter()
        self.seq += 1
        self.checks += 1
        h = 0
        for p in params:
            h = (h * 1000003 + p + 1) % MOD
        mine = torch.tensor([kind, self.step, self.seq, len(params), params[0] if params else -1,
                             params[-1] if params else -1, h, numel], dtype=torch.int64)
        got = {j: torch.empty(FIELDS, dtype=torch.int64) for j in self.peers}
        recvs = {j: dist.irecv(got[j], group=self.group, group_src=j) for j in self.peers}
        sends = [dist.isend(mine, group=self.group, group_dst=j) for j in self.peers]
        self.seconds += time.perf_counter() - start
        return Posted(mine, got, recvs, sends)

    def defer(self, kind: int, params: Sequence[int], numel: int, start: Callable) -> "Deferred":
        """[Note: agreement off the critical path] Post this collective's descriptors now and call
        `start()` (which posts its data: -> (work, result)) once they arrived and matched: at the
        first `poll` that finds them, or when the collective is waited. A check that waited at
        issue cost the small benchmark GPT 1-8 % of its step (bench/RESULTS.md). Only
        point-to-point collectives can wait this way; native ones (gloo's own, NCCL, HCCL) and
        the grad norm's all-reduce `check` at issue."""
        d = Deferred(self, self.post(kind, params, numel), start)
        self.deferred.append(d)
        return d

    def poll(self) -> None:
        """Post every deferred collective whose peers' descriptors have arrived, in issue order."""
        if self.failed is not None:  # diverged: nothing more is posted (nor waited)
            self.deferred.clear()
            return
        while self.deferred and (self.deferred[0].work is not None or self.arrived(self.deferred[0].posted)):
            self.deferred.popleft().post()

    @staticmethod
    def arrived(posted: "Posted") -> bool:
        """Every peer's descriptor is here (resolve will not wait)."""
        return all(w.is_completed() for w in posted.recvs.values())

    def resolve(self, posted: "Posted") -> None:
        """Wait for the peers' descriptors; raise DivergenceError unless they equal this rank's.
        After a DivergenceError the ranks are out of step for good: every later call raises it."""
        if self.failed is not None:
            raise self.failed
        try:
            self._resolve(posted)
        except DivergenceError as e:
            self.failed = e
            raise

    def _resolve(self, posted: "Posted") -> None:
        start = time.perf_counter()
        mine, got = posted.mine, posted.got
        for j in self.peers:
            try:
                posted.recvs[j].wait(timeout=self.timeout)
            except RuntimeError as e:
                raise DivergenceError(
                    f"rank {self.rank}: rank {j} did not reach a collective within "
                    f"{self.timeout.total_seconds():.0f} s while this rank was at {self.describe(mine.tolist())} "
                    f"({type(e).__name__}: {e}). Ranks must run the same modules in the same order "
                    "(set FZ3_DIVERGENCE_TIMEOUT for a shorter wait)") from None
        for w in posted.sends:
            w.wait(timeout=self.timeout)
        self.seconds += time.perf_counter() - start
        differ = [j for j in self.peers if not torch.equal(got[j], mine)]
        if differ:
            where = {self.rank: mine.tolist(), **{j: got[j].tolist() for j in self.peers}}
            lines = "\n".join(f"  rank {r}: {self.describe(where[r])}" for r in sorted(where))
            raise DivergenceError(f"ranks diverged (seen on rank {self.rank}; ranks {sorted(differ)} differ from "
                                  f"it): each rank's next collective is\n{lines}\nEvery rank must run the same "
                                  "modules, in the same order, with the same params requiring grad; fz3 stopped "
                                  "before any data of this collective moved.")


class Deferred:
    """A point-to-point collective whose data is posted only once the ranks agreed on it; waited
    like the work it stands for."""

    __slots__ = ("agreement", "posted", "start", "work", "result")

    def __init__(self, agreement: Agreement, posted: "Posted", start: Callable) -> None:
        self.agreement, self.posted, self.start = agreement, posted, start
        self.work = self.result = None

    def post(self) -> None:
        if self.work is None:
            self.agreement.resolve(self.posted)  # raises DivergenceError: nothing was posted
            self.work, self.result = self.start()

    def wait(self) -> bool:
        self.post()
        return self.work.wait()


class Posted(NamedTuple):
    """A descriptor exchange in flight."""
    mine: torch.Tensor
    got: dict
    recvs: dict
    sends: list


def describe_with(names: Sequence[str], owner: Sequence[str]) -> Callable[[Sequence[int]], str]:
    """A describe function over the model's param names and each param's owning module name."""
    def describe(v: Sequence[int]) -> str:
        kind, step, seq, n, first, last, _, numel = v
        what = KINDS.get(kind, f"collective kind {kind}")
        head = f"step {step + 1}, collective {seq}: {what}"
        if n <= 0:
            return head
        if not (0 <= first < len(names) and 0 <= last < len(names)):
            return f"{head} of {n} params (ids {first}..{last}, not this model's)"
        module = owner[first] or "<root>"
        params = repr(names[first]) if n == 1 else f"{names[first]!r} .. {names[last]!r}"
        return f"{head} of {n} param{'s' if n > 1 else ''} ({params}, {numel:,} elements) of module {module!r}"
    return describe
