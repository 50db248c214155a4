"""Ranks agree on each collective before any of its data is received; ranks that diverge raise
DivergenceError instead of hanging.

ZeRO-3 is SPMD: every rank must issue the same collectives in the same order. If their control
flow diverges (data-dependent branches, a rank skipping a block), DeepSpeed and FSDP exchange
data meant for different collectives, or hang until the process group's timeout (30 minutes by
default). fz3 checks instead.

Before each collective of the interpreter (all-gather, reduce, the grad norm's all-reduce, the
buffers' broadcast, the leaf-grad flags' all-reduce), every
rank sends the others a descriptor of it, nine integers:

    kind, optimizer step, collective number in that step, params, first and last ParamId,
    a hash of the ParamIds, elements, and (gathers and reduces) the pass it is made in: grad
    mode, train/eval mode, forward or backward (pass_hint.py: [Note: rank-only evaluation])

and compares what it receives with its own. The exchange is point-to-point messages under one
tag of their own, `DESCRIPTORS`: the k-th descriptor of one rank always pairs with the k-th of
every other. On gloo they go over the training group itself (sharing its connections costs less
than a second group's: [Note: descriptors beside the data]); on NCCL and HCCL, whose
point-to-point messages have no tags, over a gloo side group created at initialize. So a rank
that runs an extra module, skips one, or runs a backward the others do not is caught at the
first collective where the descriptors differ. Every rank then raises
DivergenceError, naming each rank's step, collective and params (and the module that owns them);
when those are modules under one parent, it names the parent as the leaf module that would make
them one fetch unit (leaf_hint.py: an MoE whose experts run only when routed to); when the
ranks are in different kinds of pass, it says which rank runs what (pass_hint.py: an evaluation
on rank 0 alone).

No data meant for another collective is ever received:

- Point-to-point collectives (gloo's default carrier) post their data at once, in messages whose
  tag is made from the descriptor (`Posted.tag`). A receive matches only a send of the same tag,
  so data moves only between ranks that are at the same collective; the descriptors are compared
  when the collective is waited, before its result is used (`Guarded`). This adds no round trip:
  the descriptors travel beside the data ([Note: descriptors beside the data]).
- Native collectives (gloo's own, NCCL, HCCL) have no tags. Run asynchronously (overlap_comm),
  their descriptors are posted and their data right after (`ahead`); the descriptors are
  compared when the collective is waited, before its result is used, or at the latest when the
  optimizer step ends ([Note: native collectives checked ahead]). Run synchronously, they wait
  for the descriptors at issue, before their data is posted (`check`): a mismatched synchronous
  collective would block the host before any comparison.
- The grad norm's all-reduce is itself the exchange: its one float64 rides in the descriptor
  message (`all_reduce_sum`), so it costs no more than the all-reduce it replaces.

A rank that raised out of training or exited closes its connections: the others' waits fail at
once, and each names that rank as gone and the collective it was at (`Agreement.lost`). A rank
that is alive but issues no collective (it blocks in code of its own, or waits in a collective
the others never run) is reported once the others have waited the process group's own timeout
(what init_process_group was given; `FZ3_DIVERGENCE_TIMEOUT` seconds instead when set), so that
a slow rank is never mistaken for a diverged one ([Note: gone or stalled]). Waits on the
collectives' data fail the same way when a peer leaves mid-collective (`Guarded`, `Watched`).

After a DivergenceError the ranks are out of step for good (the k-th descriptor of each rank
pairs with the k-th of every other; a rank may have sent ones the others never took), so every
later collective raises it again and `on_failure` tells the engine, which then refuses every
call ([Note: an engine stops at a DivergenceError], fz3/shell/engine.py). The check is always on
(bench/diagnostics/divergence_overhead.py measures it). FZ3_DIVERGENCE_CHECK=0 turns it off, for that
measurement.
"""
from __future__ import annotations

import datetime
import os
import time
from typing import Callable, Mapping, NamedTuple, Sequence

import torch

from fz3.interpreters import pass_hint
from fz3.interpreters.threads import WorldFailed
from fz3.interpreters.transport import PeerFailed, Transport

GATHER, REDUCE, NORM, BUFFERS, FLAGS = 1, 2, 3, 4, 5
OPTIMIZER_STATE, FULL_STATE, SIXTEEN_BIT, SAVE, LOAD = 6, 7, 8, 9, 10
ACROSS = 11  # hybrid sharding: a bucket's partitions all-reduced across the groups
FULL_PARAMS, GENERATION = 12, 13  # engine.full_params(), engine.generation()
CALLS = {OPTIMIZER_STATE: "engine.full_optimizer_state_dict()", FULL_STATE: "engine.full_state_dict()",
         SIXTEEN_BIT: "engine.save_16bit_model() (or _zero3_consolidated_16bit_state_dict())",
         SAVE: "engine.save_checkpoint()", LOAD: "engine.load_checkpoint()", FULL_PARAMS: "engine.full_params()",
         GENERATION: "engine.generation()"}
"""The kinds that are a call of the user's, not of the engine's hooks: a rank there alone called
it where the others did not (under `if master_process:`). Each is checked as the call begins
(fz3.interpreters.agree.every_rank), before its first collective."""
KINDS = {GATHER: "all-gather", REDUCE: "reduce", NORM: "grad-norm all-reduce", BUFFERS: "buffer broadcast",
         FLAGS: "all-reduce of which leaf params got a grad",
         OPTIMIZER_STATE: "engine.full_optimizer_state_dict()'s gather of the optimizer state",
         FULL_STATE: "engine.full_state_dict()'s gather of the params",
         SIXTEEN_BIT: "engine.save_16bit_model()'s (or _zero3_consolidated_16bit_state_dict()'s) gather of the "
                      "16-bit weights",
         SAVE: "engine.save_checkpoint()", LOAD: "engine.load_checkpoint()",
         ACROSS: "all-reduce of a bucket's partitions across the shard groups",
         FULL_PARAMS: "engine.full_params()", GENERATION: "engine.generation()"}
FIELDS = 9  # compared
PHASE_FIELD = 8  # the pass a gather or reduce is made in (pass_hint.py); 0 for the other kinds
STAMPED = (GATHER, REDUCE)
MESSAGE = FIELDS + 1  # and one int64 of payload (the grad norm's all-reduce)
MOD = (1 << 61) - 1


class DivergenceError(RuntimeError):
    """Ranks issued different collectives (a different module order, different params), or a
    rank left (it raised out of training or exited) or stopped issuing them. Raised on every
    rank that sees it, before any data of the mismatched collective is received; the message
    gives each rank's position. The engine raises one too at every call after the first (its
    message names the first, its __cause__)."""


def enabled() -> bool:
    return os.environ.get("FZ3_DIVERGENCE_CHECK", "1") != "0"


def timeout_for(comm: Transport) -> tuple[datetime.timedelta, str]:
    """How long a rank waits for a peer's descriptor, and whose figure that is:
    FZ3_DIVERGENCE_TIMEOUT seconds when set, else the transport's own (the process group's
    timeout; run_threads' timeout_s on a thread world)."""
    value = os.environ.get("FZ3_DIVERGENCE_TIMEOUT")
    if value is None:
        whose = "run_threads' timeout_s" if comm.backend == "threads" else "the process group's timeout"
        return comm.timeout(), whose
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if seconds <= 0:
        raise ValueError(f"FZ3_DIVERGENCE_TIMEOUT={value!r}: give seconds, a number > 0")
    return datetime.timedelta(seconds=seconds), "FZ3_DIVERGENCE_TIMEOUT"


class Agreement:
    """One rank's side of the descriptor exchange."""

    def __init__(self, comm: Transport, describe: Callable[[Sequence[int]], str]) -> None:
        """`comm`: where the descriptors travel (its point-to-point messages must have tags)."""
        self.comm, self.rank, self.world_size, self.describe = comm, comm.rank, comm.world_size, describe
        self.peers = [j for j in range(self.world_size) if j != self.rank]
        self.timeout, self.timeout_from = timeout_for(comm)
        self.step = 0  # optimizer steps so far
        self.seq = 0  # collectives in this step
        self.checks = 0  # collectives checked in all
        self.failed: DivergenceError | None = None  # once raised, every later collective raises it
        self.on_failure: Callable[[DivergenceError], None] | None = None  # told of it, once (the engine)
        self.hint: Callable[[Mapping[int, Sequence[int]]], str] = lambda where: ""  # leaf_hint
        self.phase: Callable[[], int] = lambda: 0  # this rank's pass now (pass_hint.phase_reader)
        self.stamping = True  # gathers and reduces carry `phase()` (off: the step's refresh)
        self.seconds = 0.0  # spent checking (bench/diagnostics/divergence_overhead.py reports it)
        self.unresolved: list[Posted] = []  # posted `ahead`, oldest first, not yet compared

    @classmethod
    def for_transport(cls, comm: Transport, describe: Callable[[Sequence[int]], str]) -> "Agreement | None":
        """The check for the collectives `comm` carries; None when off or alone. Every rank must
        call it (it may create a side group: Transport.side)."""
        if comm.world_size < 2 or not enabled():
            return None
        return cls(comm.side(), describe)

    def next_step(self) -> None:
        """The optimizer step is over: every exchange still unresolved is compared now (a
        native collective posted `ahead` and never waited, the grad norm's all-reduce)."""
        self.settle()
        self.step += 1
        self.seq = 0

    def ahead(self, kind: int, params: Sequence[int], numel: int) -> "Posted":
        """[Note: native collectives checked ahead] Post this native collective's descriptors
        without waiting for the peers': its data may be posted at once, and `resolve` (at its
        wait, at any later resolve, at the step's end) compares them before any of it is used."""
        posted = self.post(kind, params, numel)._replace(ahead=True)
        self.unresolved.append(posted)
        return posted

    def settle(self) -> None:
        """Compare every exchange posted `ahead` and not yet resolved, oldest first."""
        while self.unresolved:
            self.resolve(self.unresolved[0])

    def check(self, kind: int, params: Sequence[int], numel: int) -> "Posted":
        """Raise DivergenceError unless every rank is about to run this same collective; -> its
        descriptors (`issue` names the collective if its data fails)."""
        posted = self.post(kind, params, numel)
        self.resolve(posted)
        return posted

    def post(self, kind: int, params: Sequence[int], numel: int, payload: int = 0) -> "Posted":
        """Send this collective's descriptor (and one int64 of `payload`, not compared) to every
        peer and post the receives of theirs; `resolve` compares them. Until then, the
        collective's data may travel only under `Posted.tag`."""
        if self.failed is not None:
            raise self.failed
        start = time.perf_counter()
        self.seq += 1
        self.checks += 1
        h = 0
        for p in params:
            h = (h * 1000003 + p + 1) % MOD
        phase = self.phase() if kind in STAMPED and self.stamping else 0
        fields = (kind, self.step, self.seq, len(params), params[0] if params else -1,
                  params[-1] if params else -1, h, numel, phase)
        mine = torch.tensor([*fields, payload], dtype=torch.int64)
        got = {j: torch.empty(MESSAGE, dtype=torch.int64) for j in self.peers}
        recvs = {j: self.comm.irecv(got[j], j, DESCRIPTORS) for j in self.peers}
        sends = [self.comm.isend(mine, j, DESCRIPTORS) for j in self.peers]
        self.seconds += time.perf_counter() - start
        return Posted(mine, got, recvs, sends, tag_of(fields))

    def guard(self, posted: "Posted", work) -> "Guarded":
        """[Note: descriptors beside the data] `work` was posted under `posted.tag`: waiting the
        result first waits for the peers' descriptors and raises DivergenceError unless they
        match. A check that waited for them before posting the data (as native collectives
        must) cost the small benchmark GPT 1-8 % of its step, and one that posted the data
        once the descriptors had arrived, 3.5 % (bench/RESULTS.md, "The divergence check").
        An on-demand 1 MiB gather between 2 gloo ranks took 1.0 ms unchecked, 1.5 ms with its
        descriptors on a gloo side group and 1.2 ms with them on the training group itself, one
        connection and one transport thread per pair instead of two (bench/diagnostics/agreement_latency.py)."""
        return Guarded(self, posted, work)

    def issue(self, posted: "Posted", post: Callable[[], object]):
        """Post the native collective `posted` describes (its descriptors agreed, or were posted
        `ahead`): `post()` -> its work, or None when it ran synchronously. A failure of the post
        or of the work's wait is a DivergenceError naming it (`lost`: a peer left mid-collective),
        not a raw one. Posted ahead, its wait compares the descriptors first (Guarded)."""
        work = _data(self, posted, post)
        if work is None:
            return None
        return Guarded(self, posted, work) if posted.ahead else Watched(self, posted, work)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """The SUM over ranks of a one-element CPU float64 tensor, in its descriptor exchange:
        each rank adds the values in rank order, so every rank gets the same bits."""
        if t.numel() != 1 or t.dtype != torch.float64 or t.device.type != "cpu":
            raise ValueError(f"Agreement.all_reduce_sum takes one CPU float64 element, not {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")
        posted = self.post(NORM, (), 1, payload=int(t.view(torch.int64)))
        self.resolve(posted)
        values = {self.rank: t.reshape(()), **{j: posted.got[j][FIELDS:].view(torch.float64)[0] for j in self.peers}}
        total = values[0].clone()
        for j in range(1, self.world_size):
            total += values[j]
        return t.copy_(total.reshape(t.shape))

    def resolve(self, posted: "Posted") -> None:
        """Wait for the peers' descriptors; raise DivergenceError unless they equal this rank's
        (and those of every exchange posted `ahead` before it, first: the first divergence is
        the one named). After a DivergenceError the ranks are out of step for good: every later
        call raises it."""
        if self.failed is not None:
            raise self.failed
        try:
            while self.unresolved:
                first = self.unresolved.pop(0)
                self._resolve(first)
                if first is posted:
                    return
            if not posted.ahead:  # (one posted ahead and gone from the list was compared already)
                self._resolve(posted)
        except DivergenceError as e:
            self.fail(e)
            raise

    def fail(self, e: DivergenceError) -> None:
        """Record the first DivergenceError (every later collective raises it) and tell
        `on_failure`."""
        if self.failed is None:
            self.failed = e
            if self.on_failure is not None:
                self.on_failure(e)

    def _resolve(self, posted: "Posted") -> None:
        start = time.perf_counter()
        mine, got = posted.mine[:FIELDS], {j: g[:FIELDS] for j, g in posted.got.items()}
        for works in (posted.recvs.values(), posted.sends):
            for j, w in zip(self.peers, works):
                try:
                    w.wait(timeout=self.timeout)
                except RuntimeError as e:
                    raise self.lost(j, e, time.perf_counter() - start, posted) from e
        self.seconds += time.perf_counter() - start
        differ = [j for j in self.peers if not torch.equal(got[j], mine)]
        if differ:
            where = {self.rank: mine.tolist(), **{j: got[j].tolist() for j in self.peers}}
            lines = "\n".join(f"  rank {r}: {self.describe(where[r])}" for r in sorted(where))
            passes = pass_hint.pass_hint(where, PHASE_FIELD)
            hint = "" if passes else self.hint(where)
            called = sorted({CALLS[v[0]] for v in where.values() if v[0] in CALLS})
            rule = (f"{' and '.join(called)} needs every rank (each holds only its shards): every rank must call "
                    "it at the same point of its program, not under `if master_process:`." if called else
                    passes or "Every rank must run the same modules, in the same order, with the same params "
                              "requiring grad.")
            stopped = ("fz3 stopped before any data of this collective was used (the backend's own collectives "
                       "have no tags: it was posted beside its descriptors)." if posted.ahead else
                       "fz3 stopped before any data of this collective was received.")
            raise DivergenceError(f"ranks diverged (seen on rank {self.rank}; ranks {sorted(differ)} differ from "
                                  f"it): each rank's next collective is\n{lines}\n{rule} {stopped}"
                                  + (f"\n{hint}" if hint else ""))

    def lost(self, j: int | None, error: BaseException, waited: float, posted: "Posted") -> DivergenceError:
        """The error for a wait on rank `j` (None: some peer) that failed `waited` seconds in,
        this rank being at the collective `posted` describes. [Note: gone or stalled] A wait
        that fails well before the timeout failed because the peer's end is gone: a rank that
        raises out of training or exits closes its connections, and gloo fails every wait on
        them at once ("Connection closed by peer", "Connection reset by peer"). Only a wait that
        ran the whole timeout is a peer alive and elsewhere."""
        who, where = ("a peer" if j is None else f"rank {j}"), self.describe(posted.mine[:FIELDS].tolist())
        why = f"{type(error).__name__}: {error}"
        limit = self.timeout.total_seconds()
        if isinstance(error, WorldFailed):  # a thread world's: the reason is in it
            return DivergenceError(f"rank {self.rank}: {who} will not come to this rank's {where} ({why})")
        if waited < 0.9 * limit:
            return DivergenceError(
                f"rank {self.rank}: {who} exited or closed its connection: this rank's wait for it failed "
                f"{waited:.1f} s in, long before the {limit:.0f} s timeout, while this rank was at {where} "
                f"({why}). A rank closes its connections when an error ends its process or it exits; its "
                "own output says why.")
        return DivergenceError(
            f"rank {self.rank}: {who} did not reach a collective within {limit:.0f} s ({self.timeout_from}) "
            f"while this rank was at {where} ({why}). It is alive but issues no collective: it blocks in code "
            "of its own, or waits in a collective this rank does not run. Every rank must run the same "
            "modules in the same order.")


DESCRIPTORS = 2**31 - 1
"""The tag of the descriptor messages (gloo takes 0 <= tag < 2**31); no data tag is this one."""


def tag_of(fields: Sequence[int]) -> int:
    """A point-to-point tag made from a descriptor, below DESCRIPTORS: ranks at different
    collectives post different tags, so their messages never match."""
    h = 0
    for f in fields:
        h = (h * 1000003 + f + 1) % MOD
    return h % DESCRIPTORS


class Guarded:
    """Point-to-point work posted under a descriptor's tag, waited like it: the descriptors are
    compared first (DivergenceError: the data was never received)."""

    __slots__ = ("agreement", "posted", "work")

    def __init__(self, agreement: Agreement, posted: "Posted", work) -> None:
        self.agreement, self.posted, self.work = agreement, posted, work

    def wait(self) -> bool:
        self.agreement.resolve(self.posted)
        return _data(self.agreement, self.posted, self.work.wait)


class Watched(Guarded):
    """Native work whose descriptors were compared before its data was posted (`check`)."""

    __slots__ = ()

    def wait(self) -> bool:
        return _data(self.agreement, self.posted, self.work.wait)


def _data(ag: Agreement, posted: "Posted", move: Callable[[], object]):
    """move() (post or wait the collective's data): a peer that left mid-collective is a
    DivergenceError (`Agreement.lost`), and the ranks are out of step from there on."""
    began = time.monotonic()
    try:
        return move()
    except RuntimeError as e:
        peer = e.peer if isinstance(e, PeerFailed) else None
        lost = ag.lost(peer, e.error if isinstance(e, PeerFailed) else e, time.monotonic() - began, posted)
        ag.fail(lost)
        raise lost from e


class Posted(NamedTuple):
    """A descriptor exchange in flight."""
    mine: torch.Tensor
    got: dict
    recvs: dict
    sends: list
    tag: int
    ahead: bool = False  # a native collective posted before its descriptors were compared (`ahead`)


def describe_with(names: Sequence[str], owner: Sequence[str | Sequence[str]]) -> Callable[[Sequence[int]], str]:
    """A describe function over the model's param names and each param's owning module name (a
    tied param: the names of the modules that share it, the first named first)."""
    def describe(v: Sequence[int]) -> str:
        kind, step, seq, n, first, last, _, numel = v[:8]
        mode = pass_hint.words(v[PHASE_FIELD]) if len(v) > PHASE_FIELD else ""
        mode = f", {mode}" if mode else ""
        what = KINDS.get(kind, f"collective kind {kind}")
        head = f"step {step + 1}, collective {seq}: {what}"
        if n <= 0:
            return head + mode
        if not (0 <= first < len(names) and 0 <= last < len(names)):
            return f"{head} of {n} params (ids {first}..{last}, not this model's){mode}"
        own = (owner[first],) if isinstance(owner[first], str) else tuple(owner[first]) or ("",)
        module = repr(own[0] or "<root>") + (f" (shared with {', '.join(map(repr, own[1:]))})" if len(own) > 1 else "")
        params = repr(names[first]) if n == 1 else f"{names[first]!r} .. {names[last]!r}"
        return f"{head} of {n} param{'s' if n > 1 else ''} ({params}, {numel:,} elements) of module {module}{mode}"
    return describe

