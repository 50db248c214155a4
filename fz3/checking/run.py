"""Running one example of fz3.check: the user's model in one process, and on W thread ranks.

    ref = reference(subject, job)        # plain PyTorch, the arithmetic fz3 does ([Note: ...])
    ranks = on_ranks(subject, job)       # fz3.initialize on W thread ranks; RankRun per rank
    on_ranks(subject, replace(job, diagnose=True))   # the same, every torch call of the model
                                         # watched for a read of a param fz3 had released

Both train `job.steps` optimizer steps of gradient_accumulation_steps micro-steps; micro-step i
takes example batch i % n, split among the ranks (fz3/checking/build.py), and draws its
random numbers (dropout) from torch.manual_seed(seed_for(i, r)) for rank r's slice, on both
sides: the thread ranks each keep a generator stream of their own (run_threads(private_rng=True),
[Note: a private RNG per rank] in fz3/interpreters/threads.py), so rank r's dropout masks are
the reference's for the same slice.

[Note: the check's reference] tests/support/parity.py's reference, made to do fz3's arithmetic in
its order: per micro-step, each rank's slice runs forward and backward alone (its loss undivided,
as engine.backward takes it); the grads of the W slices are summed in rank order in the dtype
fz3 reduces in (communication_data_type, else the grad's), then added into fp32 accumulators
(the first micro-step's copied), and at the boundary divided once by W x gas; then the global
norm (a non-finite one skips the step, as fz3 does), clipping, the optimizer on fp32 params.
With bf16 compute the model runs in bf16 (params cast from fp32 masters after every step, floating
inputs cast as fz3 casts them at the root) and the optimizer steps on the fp32 masters. So fp32
runs match bit for bit on 1 and 2 ranks, and to a few ulps where fz3's reduce adds the ranks in
another order (the p2p carrier adds its own slice first: on 3 ranks rank 2 sums g2 + g0 + g1).
Not mimicked: gradient_predivide_factor and prescale_gradients (the tolerance covers them).

Buffers: each rank keeps its own; with Options(broadcast_buffers=True) every forward pass starts
from rank 0's (fz3/shell/buffers.py, DDP's rule), so the reference runs each rank's slice on
that rank's buffers and, broadcasting, starts the k-th pass of every rank's slice from what rank
0's k-th pass started from. Both sides record the buffers at every pass start.

The reference also notes what plain PyTorch cannot tell apart from training: a param whose
value changed during a slice's forward and backward (an in-place write outside autograd: fz3
writes into a gathered copy that it frees) and the buffers a forward updated.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from fz3.config.config import COMM_DTYPES, Config
from fz3.config.options import Options
from fz3.core.param.state import AVAILABLE
from fz3.data.store import DTYPES
from fz3.interpreters.threads import run_threads
from fz3.checking.build import CheckInputError, Subject, copies, loss_backward, rank_batch, unique_params
from fz3.checking.watch import Watch
from fz3.shell import pytree


@dataclass(frozen=True)
class Job:
    """What one run needs besides the subject."""

    world_size: int
    steps: int
    config: Config
    options: Options
    optimizer: Callable[[Any], torch.optim.Optimizer]
    seed: int
    initialize: Callable[..., Any] = None  # fz3.initialize (passed down: fz3/api.py)
    timeout_s: float = 600.0
    diagnose: bool = False  # watch every torch call for a read of a released param (slow)

    @property
    def micro_steps(self) -> int:
        return self.steps * self.config.gradient_accumulation_steps


def seed_for(seed: int, micro: int, rank: int) -> int:
    return (seed * 1_000_003 + micro) * 1_009 + rank


@dataclass
class Reference:
    losses: list[list[float]] = field(default_factory=list)  # [micro-step][rank]
    params: list[dict[str, torch.Tensor]] = field(default_factory=list)  # fp32, after each step
    passes: list[list[list[dict]]] = field(default_factory=list)  # [micro][rank][pass] buffers at its start
    written: list[tuple[int, int, str]] = field(default_factory=list)  # (micro, rank, param) changed in a slice
    updated: list[str] = field(default_factory=list)  # buffers some forward changed
    skipped: list[int] = field(default_factory=list)  # steps whose grad norm was not finite


@dataclass
class RankRun:
    rank: int
    losses: list[float] = field(default_factory=list)
    params: list[dict[str, torch.Tensor]] = field(default_factory=list)  # rank 0: after each step
    passes: list[list[dict]] = field(default_factory=list)  # [micro][pass] buffers at its start
    effects: dict[int, list] = field(default_factory=dict)
    entered: dict[int, list[str]] = field(default_factory=dict)
    callers: dict[int, list[str]] = field(default_factory=dict)
    i1: Optional[str] = None
    reach: Optional[str] = None
    i2: Optional[str] = None
    micro: int = -1  # the micro-step running (or last run)
    error: Optional[BaseException] = None
    param_names: tuple[str, ...] = ()  # by ParamId, for the effects' params


# ---- the reference --------------------------------------------------------------------------------

def reference(subject: Subject, job: Job) -> Reference:
    """[Note: the check's reference], in the calling thread, one intra-op thread (as the ranks)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rng = torch.get_rng_state()
    try:
        return _reference(subject, job)
    finally:
        torch.set_num_threads(threads)
        torch.set_rng_state(rng)


def _reference(subject: Subject, job: Job) -> Reference:
    cfg, W = job.config, job.world_size
    gas = cfg.gradient_accumulation_steps
    model = copies(subject.model, 1)[0]
    named = unique_params(model)
    dtype = DTYPES[cfg.compute_dtype]
    if dtype == torch.float32:
        masters = [p for _, p in named]
    else:
        masters = [nn.Parameter(p.detach().float().clone(), requires_grad=p.requires_grad) for _, p in named]
        model.to(dtype)
        model.register_forward_pre_hook(lambda m, a, k: cast_floating((a, k), dtype), with_kwargs=True)
    optimizer = job.optimizer(masters)
    buffers = BufferWorld(model, W, job.options.broadcast_buffers)
    out = Reference(updated=[])
    for step in range(job.steps):
        acc: list[Optional[torch.Tensor]] = [None] * len(named)
        for m in range(gas):
            i = step * gas + m
            total = _micro_step(subject, job, model, named, buffers, out, i)
            for k, t in enumerate(total):
                if t is not None:
                    acc[k] = t.float() if acc[k] is None else acc[k].add_(t)
        _optimizer_step(job, named, masters, acc, optimizer, out, step)
    out.passes = buffers.seen
    out.updated = sorted(buffers.updated)
    return out


def _micro_step(subject: Subject, job: Job, model: nn.Module, named, buffers: "BufferWorld", out: Reference,
                i: int) -> list[Optional[torch.Tensor]]:
    """Every rank's slice of micro-step i, forward and backward alone; -> per param the sum of the
    ranks' grads in rank order, in the dtype fz3 reduces in (None: no rank's slice gave one)."""
    W, n = job.world_size, len(subject.batches)
    batch, rows = subject.batches[i % n], subject.rows[i % n]
    comm = job.config.communication_data_type
    total: list[Optional[torch.Tensor]] = [None] * len(named)
    got = [False] * len(named)
    losses = []
    for r in range(W):
        for _, p in named:
            p.grad = None
        before = [p.detach().clone() for _, p in named]
        buffers.begin(i, r)
        torch.manual_seed(seed_for(job.seed, i, r))
        loss = loss_backward(subject.loss_fn, model, rank_batch(batch, rows, r, W), "loss_fn(model, batch)",
                             f"the model raised in plain PyTorch, in one process (micro-step {i}, rank {r}'s "
                             f"slice of example batch {i % n}):")
        buffers.end(r)
        losses.append(loss.item())
        for k, (name, p) in enumerate(named):
            if not _same(p.detach(), before[k]):
                out.written.append((i, r, name))
            if not p.requires_grad:
                continue
            dtype = DTYPES_BY_NAME.get(comm) or (p.grad.dtype if p.grad is not None else p.dtype)
            g = torch.zeros_like(p, dtype=dtype) if p.grad is None else p.grad.to(dtype)
            got[k] = got[k] or p.grad is not None
            total[k] = g.clone() if total[k] is None else total[k].add_(g)
    out.losses.append(losses)
    return [t if g else None for t, g in zip(total, got)]


DTYPES_BY_NAME = {k: getattr(torch, v) for k, v in COMM_DTYPES.items()}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, a NaN equal to a NaN where both have one."""
    return torch.equal(a, b) or bool(((a == b) | (a.isnan() & b.isnan())).all())


def _optimizer_step(job: Job, named, masters, acc, optimizer, out: Reference, step: int) -> None:
    """At the boundary: divide once, the global norm (not finite: skip), clip, step, cast back."""
    divisor = job.world_size * job.config.gradient_accumulation_steps
    grads = [None if a is None else a.div_(divisor) for a in acc]
    present = [g for g in grads if g is not None]
    norm = math.sqrt(sum(g.double().square().sum().item() for g in present)) if present else 0.0
    if not math.isfinite(norm):
        out.skipped.append(step + 1)
    else:
        clip = job.config.gradient_clipping
        if clip > 0:
            coef = min(clip / (norm + 1e-6), 1.0)
            for g in present:
                g.mul_(torch.tensor(coef, dtype=torch.float32))
        for master, g in zip(masters, grads):
            master.grad = g
        optimizer.step()
        for master in masters:
            master.grad = None
        if masters[0] is not named[0][1]:  # bf16: the model's params are cast from the masters
            with torch.no_grad():
                for (_, p), master in zip(named, masters):
                    p.copy_(master)
    out.params.append({name: master.detach().float().clone() for (name, _), master in zip(named, masters)})


def cast_floating(tree, dtype: torch.dtype):
    """fz3's cast of a root call's floating inputs to the compute dtype (fz3/shell/engine.py)."""
    leaves, spec = pytree.flatten(tree)
    return pytree.unflatten(spec, [x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
                                   for x in leaves])


class BufferWorld:
    """The reference's buffers: each rank's own, and with broadcasting every rank's k-th pass of a
    micro-step starting from what rank 0's k-th pass started from (fz3/shell/buffers.py)."""

    def __init__(self, model: nn.Module, world_size: int, broadcast: bool) -> None:
        self.model, self.world_size, self.broadcast = model, world_size, broadcast and world_size > 1
        self.on = any(True for _ in model.buffers())
        start = _buffers(model)
        self.states = [start] * world_size
        self.seen: list[list[list[dict]]] = []
        self.updated: set[str] = set()
        self.micro = self.rank = 0
        if self.on:
            model.register_forward_pre_hook(self._pass)

    def begin(self, micro: int, rank: int) -> None:
        self.micro, self.rank = micro, rank
        if micro == len(self.seen):
            self.seen.append([[] for _ in range(self.world_size)])
        if self.on:
            _load(self.model, self.states[rank])

    def _pass(self, module, args) -> None:
        passes = self.seen[self.micro][self.rank]
        if self.broadcast and self.rank > 0 and len(passes) < len(self.seen[self.micro][0]):
            _load(self.model, self.seen[self.micro][0][len(passes)])
        passes.append(_buffers(self.model))

    def end(self, rank: int) -> None:
        if not self.on:
            return
        after = _buffers(self.model)
        for name, t in after.items():
            starts = self.seen[self.micro][rank]
            if starts and not torch.equal(t, starts[-1][name]):
                self.updated.add(name)
        self.states[rank] = after


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in model.named_buffers()}


def _load(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, b in model.named_buffers():
            want = state.get(name)
            if want is None:
                continue
            if b.shape == want.shape and b.dtype == want.dtype:
                b.copy_(want)
            else:  # the model replaced it: put the value back as it was
                owner, _, leaf = name.rpartition(".")
                model.get_submodule(owner)._buffers[leaf] = want.clone()


# ---- the thread ranks -----------------------------------------------------------------------------

def on_ranks(subject: Subject, job: Job) -> list[RankRun]:
    """The example on W thread ranks of this process, fz3.initialize's engine on each; every
    rank's RankRun, with the error it stopped at, if any (a rank that stopped only because
    another failed has a WorldFailed or a DivergenceError naming that rank)."""
    models = copies(subject.model, job.world_size)
    return run_threads(_rank, job.world_size, args=(subject, job, models), timeout_s=job.timeout_s,
                       private_rng=True)


def _rank(rank: int, world_size: int, subject: Subject, job: Job, models: list[nn.Module]) -> RankRun:
    """One thread rank: its engine, the example's micro-steps, what it saw; an error is recorded,
    with the micro-step it stopped at, not raised."""
    out = RankRun(rank)
    model, watch = models[rank], None
    try:
        engine = job.initialize(model, job.optimizer(model.parameters()), job.config, options=job.options)
        out.param_names = tuple(engine.tables.names)
        watch = Watch(engine)
        if any(True for _ in model.buffers()):  # after fz3's own pre-hook: what its broadcast left
            model.register_forward_pre_hook(lambda m, a: out.passes[out.micro].append(_buffers(m)))
        reads = ReleasedReads(engine, watch) if job.diagnose else None
        with reads if reads is not None else contextlib.nullcontext():
            _train(out, engine, watch, subject, job, reads.fz3 if reads is not None else contextlib.nullcontext)
    except BaseException as e:  # noqa: BLE001 - reported with the rank's micro-step
        out.error = e
    finally:
        if watch is not None:
            out.effects, out.entered, out.callers = watch.effects, watch.entered, watch.callers
            out.i1, out.reach, out.i2 = watch.i1, watch.reach, watch.i2
    out.error = _without_frames(out.error)
    return out


def _train(out: RankRun, engine, watch: Watch, subject: Subject, job: Job, own) -> None:
    """The micro-steps, as a training loop runs them; `own()` marks fz3's own calls for the
    diagnosis run. Rank 0 keeps the consolidated params after each optimizer step."""
    rank, world_size, model = engine.rank, engine.world_size, engine.module
    names = [name for name, _ in unique_params(model)]
    gas, n = job.config.gradient_accumulation_steps, len(subject.batches)
    for i in range(job.micro_steps):
        out.micro = watch.micro = i
        out.passes.append([])
        batch = rank_batch(subject.batches[i % n], subject.rows[i % n], rank, world_size)
        torch.manual_seed(seed_for(job.seed, i, rank))
        loss = subject.loss_fn(model, batch)
        engine.backward(loss)
        with own():
            engine.step()
        out.losses.append(loss.item())
        if (i + 1) % gas == 0:
            with own():
                state = engine.full_state_dict()  # every rank: it gathers
            if rank == 0:
                out.params.append({name: state[name].float() for name in names})


def _without_frames(e: Optional[BaseException]) -> Optional[BaseException]:
    """The error as reported, its tracebacks dropped: their frames hold the rank's model and engine."""
    link, seen = e, set()
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        link.__traceback__ = None
        link = link.__cause__ or link.__context__
    return e


class ReleasedParamRead(RuntimeError):
    """The model read a param that fz3 had not gathered (the diagnosis run's finding)."""


METADATA = frozenset({"__get__", "__set__", "size", "dim", "numel", "is_floating_point", "is_complex", "element_size",
                      "data_ptr", "untyped_storage", "requires_grad_", "register_hook",
                      "register_post_accumulate_grad_hook", "__hash__", "__repr__", "__format__"})
"""Tensor functions that read no values: a released param may be asked them."""


class ReleasedReads(TorchFunctionMode):
    """fz3.check's diagnosis run: a torch call of the model's (not one fz3 makes itself, inside
    engine.apply, step or full_state_dict) that reads a param fz3 has not gathered raises
    ReleasedParamRead, naming the param and the modules whose forward runs. Such a read fails
    (a released param's .data is empty) or, for a param whose grad is still due, reads a
    placeholder's values without failing; the engine can see neither, as the read came through a
    reference its hooks do not watch (a list, a closure). Slow: every torch call comes here."""

    def __init__(self, engine, watch: Watch) -> None:
        super().__init__()
        self.engine, self.watch, self.inside = engine, watch, 0
        inner = engine.apply

        def apply(event, tree=None, flat=None):
            with self.fz3():
                return inner(event, tree, flat)
        engine.apply = apply  # the hooks call self.apply: the instance's attribute comes first

    @contextlib.contextmanager
    def fz3(self):
        self.inside += 1
        try:
            yield
        finally:
            self.inside -= 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if not self.inside and name not in METADATA:
            released = self._released((args, kwargs))
            if released:
                where = " > ".join(self.watch.active()) or "no module's forward (outside every fz3 unit)"
                raise ReleasedParamRead(f"{name} read param {released[0]!r} while fz3 had it released (not "
                                        f"gathered), in {where}")
        return func(*args, **(kwargs or {}))

    def _released(self, tree) -> list[str]:
        ids, st = self.engine.param_ids, self.engine.params_state
        return [self.engine.tables.names[ids[id(t)]] for t in pytree.flatten(tree)[0]
                if isinstance(t, torch.Tensor) and id(t) in ids and st.status(ids[id(t)]) != AVAILABLE]
