"""fz3.check's verdict on one example: the thread ranks' records against the reference's, and
against each other. -> Failures (the first of each check, in the order they happened), how close
the numbers were, and warnings.

    compare(example, ref, ranks, again, tol, model_modules, broadcast) -> Compared

[Note: recognised causes] A failure carries a likely cause when its signature says one:

    a param changed during a slice's      "written outside autograd": fz3 writes into a gathered
    forward/backward in one process       copy it frees (and each rank into its own), so the
                                          write is lost; plain PyTorch keeps it
    ranks entered different modules in    data-dependent control flow: the modules, and the
    one micro-step                        parent to make a leaf (leaf_hint.leaf_parent)
    a forward started from other          a buffer updated in forward without broadcast_buffers
    buffers than rank 0's
    a torch call failed on a released     a param read through a reference fz3 cannot see (a
    param (the diagnosis run)             list, a closure): its module and name
    two runs of one example differ        something besides inputs, weights and the seeded
                                          generator decides what the model runs
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from fz3.interpreters.agreement import DivergenceError
from fz3.interpreters.leaf_hint import leaf_parent
from fz3.interpreters.threads import WorldFailed
from fz3.checking.draw import Example
from fz3.checking.report import Failure
from fz3.checking.run import Reference, RankRun, ReleasedParamRead


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float


@dataclass(frozen=True)
class Compared:
    """One example's verdict: its failures in the order they happened, its warnings, and how
    close the numbers came (exact: every loss and param equal bit for bit)."""

    failures: tuple[Failure, ...] = ()
    warnings: tuple[str, ...] = ()
    exact: bool = True
    loss_dev: float = 0.0  # largest relative deviation of a loss
    param_dev: float = 0.0  # largest absolute deviation of a param element


def compare(ex: Example, ref: Reference, ranks: Sequence[RankRun], again: Optional[Sequence[RankRun]],
            tol: Tolerance, modules: Sequence[tuple[str, type]], broadcast: bool,
            diagnosis: Optional[BaseException] = None) -> Compared:
    """`again`: the second run of the example (None: not run, as after an error); `modules`:
    (path, class) of the model's modules, for the leaf to name; `diagnosis`: the error of the
    run with ReleasedReads on, after an error."""
    gas = ex.config.gradient_accumulation_steps
    found: list[tuple[float, Failure]] = []  # (when, failure)
    first = first_error(ranks)
    order_cause = _rank_order_cause(ranks, modules)
    if first is not None:
        found.append((first.micro, _error_failure(ex, first, gas, order_cause, diagnosis)))
    cause = _written_cause(ref) or released_cause(diagnosis) or order_cause
    losses, losses_exact, loss_dev = _losses(ex, ref, ranks, tol, cause)
    params, params_exact, param_dev = _params(ex, ref, ranks, tol, cause)
    found += losses + params + _buffers(ex, ref, ranks, tol, broadcast)
    for check, attr in (("I1 live budget", "i1"), ("prefetch reach", "reach"), ("I2 counts", "i2")):
        hit = next((r for r in ranks if getattr(r, attr)), None)
        if hit is not None:
            found.append((_micro_of(getattr(hit, attr)), Failure(check, ex, getattr(hit, attr), rank=hit.rank)))
    if first is None:
        found += _streams(ex, ranks, order_cause)
        if again is not None:
            found += _determinism(ex, ranks, again, released_cause(diagnosis))
    return Compared(tuple(f for _, f in sorted(found, key=lambda wf: wf[0])),
                    tuple(_warnings(ex, ref, ranks, modules, broadcast)), losses_exact and params_exact,
                    loss_dev, param_dev)


def first_error(ranks: Sequence[RankRun]) -> Optional[RankRun]:
    """The rank whose error came first: not one that only stopped because another failed."""
    errs = [r for r in ranks if r.error is not None]
    own = [r for r in errs if not _caused_by(r.error, WorldFailed)]
    return (own or errs or [None])[0]


def _caused_by(e: Optional[BaseException], kind: type) -> bool:
    while e is not None:
        if isinstance(e, kind):
            return True
        e = e.__cause__ or e.__context__
    return False


def _error_failure(ex: Example, run: RankRun, gas: int, order_cause: str,
                   diagnosis: Optional[BaseException]) -> Failure:
    e = run.error
    text = "\n      ".join(f"{type(e).__name__}: {e}".splitlines()[:14])
    step = run.micro // gas + 1 if run.micro >= 0 else None
    micro = run.micro if run.micro >= 0 else None
    if _caused_by(e, DivergenceError):
        return Failure("divergence", ex, f"rank {run.rank} raised {text}", step, micro, run.rank,
                       cause=order_cause or "the ranks issued different collectives: their control flow differs")
    where = "in fz3.initialize" if micro is None else "in training"
    return Failure("error", ex, f"rank {run.rank} raised {where}: {text}", step, micro, run.rank,
                   cause=released_cause(diagnosis) or released_cause(e) or order_cause)


def released_cause(e: Optional[BaseException]) -> str:
    """The diagnosis run's finding ([Note: recognised causes]), '' when it had none."""
    while e is not None and not isinstance(e, ReleasedParamRead):
        e = e.__cause__ or e.__context__
    if e is None:
        return ""
    return (f"{str(e).split(': ', 1)[0]}. fz3 gathers a param for the forward of the module that owns it, and "
            "for reads it sees (an attribute read of another module's param makes it external to the reader); "
            "this read came through a reference it cannot see (a list, a dict, a closure, a tensor kept from "
            "before fz3.initialize), and found an empty tensor or a placeholder's values. Read it as an attribute "
            "of its module inside forward (self.owner.weight), or keep it persistent "
            "(param_persistence_threshold >= its numel)")


def _close(got: torch.Tensor, want: torch.Tensor, tol: Tolerance) -> torch.Tensor:
    got, want = got.double(), want.double()
    ok = (got - want).abs() <= tol.atol + tol.rtol * want.abs()
    return ok | (got == want) | (got.isnan() & want.isnan())


def _losses(ex, ref: Reference, ranks, tol, cause) -> tuple[list, bool, float]:
    """The first loss beyond the tolerance (as a failure), whether all were equal, the largest
    relative deviation."""
    gas = ex.config.gradient_accumulation_steps
    exact, dev = True, 0.0
    for i, row in enumerate(ref.losses):
        for r, run in enumerate(ranks):
            if i >= len(run.losses):
                continue
            got, want = run.losses[i], row[r]
            if not (got == want or (math.isnan(got) and math.isnan(want))):
                exact, dev = False, max(dev, abs(got - want) / max(abs(want), 1e-12))
            if not bool(_close(torch.tensor(got), torch.tensor(want), tol)):
                return [(i, Failure("losses", ex, f"{got!r} on the ranks, {want!r} in one process "
                                    f"(|diff| {abs(got - want):.3g})", i // gas + 1, i, r, cause=cause))], False, dev
    return [], exact, dev


def _params(ex, ref: Reference, ranks, tol, cause) -> tuple[list, bool, float]:
    """The first param beyond the tolerance after a step (in model order), whether all were
    equal, the largest absolute deviation of an element."""
    gas = ex.config.gradient_accumulation_steps
    exact, dev = True, 0.0
    for s, (got_state, want_state) in enumerate(zip(ranks[0].params, ref.params)):
        for name, want in want_state.items():
            got = got_state[name]
            diff = (got.double() - want.double()).abs()
            if not torch.equal(got, want):
                exact = False
                dev = max(dev, float(diff.nan_to_num(math.inf).max()) if diff.numel() else 0.0)
            bad = ~_close(got, want, tol)
            if bool(bad.any()):
                k = int(torch.where(bad.reshape(-1), diff.reshape(-1).nan_to_num(math.inf), -1.0).argmax())
                at = list(torch.unravel_index(torch.tensor(k), got.shape)) if got.dim() else []
                index = f"[{', '.join(str(int(x)) for x in at)}]" if at else ""
                g, w = got.reshape(-1)[k].item(), want.reshape(-1)[k].item()
                detail = (f"{int(bad.sum())} of {got.numel()} elements differ after the step; the largest at "
                          f"{name}{index}: {g!r} on the ranks, {w!r} in one process")
                return [((s + 1) * gas - 0.5, Failure("params", ex, detail, s + 1, None, 0, name, cause))], False, dev
    return [], exact, dev


def _buffers(ex, ref: Reference, ranks, tol, broadcast: bool) -> list:
    gas = ex.config.gradient_accumulation_steps
    for i in range(min(len(ref.passes), *(len(r.passes) for r in ranks))):
        for run in ranks:
            for k, seen in enumerate(run.passes[i]):
                own = ranks[0].passes[i][k] if k < len(ranks[0].passes[i]) else seen
                want = ref.passes[i][run.rank][k] if k < len(ref.passes[i][run.rank]) else seen
                for name, t in seen.items():
                    if not torch.equal(t, own[name]):
                        return [(i, _buffer_failure(ex, i, gas, run.rank, k, name, t, own[name], broadcast))]
                    if not bool(_close(t, want[name], tol).all()):
                        detail = (f"forward pass {k} started from {_short(t)}; in one process {_short(want[name])}")
                        return [(i, Failure("buffers", ex, detail, i // gas + 1, i, run.rank, name))]
    return []


def _buffer_failure(ex, i, gas, rank, k, name, t, theirs, broadcast) -> Failure:
    detail = f"forward pass {k} started from {_short(t)} on rank {rank}, from {_short(theirs)} on rank 0"
    cause = ("a buffer updated in forward differs between ranks: with Options(broadcast_buffers=False) each rank "
             "keeps its own, updated from its own slice. Options(broadcast_buffers=True) (the default, as DDP's) "
             "starts every forward from rank 0's; or keep data-dependent state out of buffers"
             if not broadcast else "broadcast_buffers is on, yet the ranks' buffers differ at a forward's start")
    return Failure("buffers", ex, detail, i // gas + 1, i, rank, name, cause)


def _short(t: torch.Tensor) -> str:
    flat = t.reshape(-1)
    shown = ", ".join(f"{v:.6g}" if isinstance(v, float) else str(v) for v in flat[:4].tolist())
    return f"[{shown}{', ...' if flat.numel() > 4 else ''}] ({t.dtype}, {tuple(t.shape)})"


def _micro_of(text: str) -> float:
    try:
        return float(text.split("micro-step ", 1)[1].split(",", 1)[0])
    except (IndexError, ValueError):
        return math.inf


def _streams(ex, ranks, order_cause: str) -> list:
    """Ranks fed the same module events emit the same effects (I6): a difference is a divergence."""
    gas = ex.config.gradient_accumulation_steps
    for i in sorted(ranks[0].effects):
        for run in ranks[1:]:
            a, b = ranks[0].effects.get(i, []), run.effects.get(i, [])
            if a != b:
                k = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                detail = (f"its effect {k} of the micro-step is {_effect(b, k, run)}, rank 0's "
                          f"{_effect(a, k, ranks[0])} (no DivergenceError: the collectives still matched)")
                return [(i, Failure("divergence", ex, detail, i // gas + 1, i, run.rank, cause=order_cause))]
    return []


def _effect(effects: list, k: int, run: RankRun) -> str:
    if k >= len(effects):
        return "none (the micro-step ended)"
    e, names = effects[k], run.param_names
    parts = []
    for name, v in zip(e._fields, e):
        if name == "params" and names:
            v = "[" + ", ".join(names[p] for p in v) + "]"
        elif name == "param" and names:
            v = names[v]
        parts.append(f"{name}={v}")
    return f"{type(e).__name__}({', '.join(parts)})"


def _determinism(ex, ranks, again, released: str) -> list:
    gas = ex.config.gradient_accumulation_steps
    cause = released or ("something besides the inputs, the weights and the seeded torch generator decides what "
                         "the model runs: a Python global or counter, time, an unseeded random source (random, "
                         "numpy), iteration over a set")
    for one, two in zip(ranks, again):
        if two.error is not None:
            return [(two.micro, Failure("determinism", ex, f"the second run raised {type(two.error).__name__}: "
                                        f"{two.error}", two.micro // gas + 1, two.micro, two.rank, cause=cause))]
        for i in sorted(set(one.effects) | set(two.effects)):
            a, b = one.effects.get(i, []), two.effects.get(i, [])
            if a != b:
                k = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                detail = (f"effect {k} of the micro-step: {_effect(a, k, one)} in the first run, "
                          f"{_effect(b, k, two)} in the second")
                return [(i, Failure("determinism", ex, detail, i // gas + 1, i, one.rank, cause=cause))]
        for i, (x, y) in enumerate(zip(one.losses, two.losses)):
            if x != y and not (math.isnan(x) and math.isnan(y)):
                return [(i, Failure("determinism", ex, f"loss {x!r} in the first run, {y!r} in the second",
                                    i // gas + 1, i, one.rank, cause=cause))]
    return []


def _order_difference(a: RankRun, i: int, b: RankRun, j: int) -> tuple[int, str, str, list[str]]:
    """Where the calls of a's micro-step i and b's micro-step j depart: (call k, a's module, b's
    module, the modules whose forward ran around each of them: where the choice was made)."""
    x, y = a.entered.get(i, []), b.entered.get(j, [])
    k = next((k for k, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
    ended = "(none: the pass ended)"
    around = [run.callers.get(m, [])[k] for run, m, seq in ((a, i, x), (b, j, y)) if k < len(seq)]
    return k, (x[k] if k < len(x) else ended), (y[k] if k < len(y) else ended), [c for c in around if c]


def _leaf_fix(around: Sequence[str], modules) -> str:
    """The leaf to mark: the module nearest the calls' common caller that has a forward."""
    found = leaf_parent([c for c in around if c != "<root>"], modules) if around else None
    if found is None:
        return ("the choice is made in the model's own forward: fz3 copes with an order that changes from pass to "
                "pass (without prefetch), but every rank must call the same modules in a pass; move the choice "
                "into a module and make that a leaf (fz3.set_leaf_modules(model, [Cls]) before fz3.initialize)")
    path, cls = found
    return (f"if {path!r} ({cls}) picks its submodules from its input, make it a leaf: fz3.set_leaf_modules(model, "
            f"[{cls}]) before fz3.initialize, or Config(leaf_module_classes=({cls!r},)); a leaf is one fetch unit "
            "every rank gathers and reduces whole")


def _rank_order_cause(ranks: Sequence[RankRun], modules) -> str:
    """Ranks that entered different modules in one micro-step: data-dependent control flow."""
    for i in sorted(ranks[0].entered):
        for run in ranks[1:]:
            a, b = ranks[0].entered.get(i, []), run.entered.get(i, [])
            n = min(len(a), len(b))
            if a[:n] != b[:n]:
                k, x, y, around = _order_difference(ranks[0], i, run, i)
                return (f"data-dependent control flow differs between ranks: in micro-step {i} rank 0's call {k} "
                        f"entered {x!r}, rank {run.rank}'s {y!r}; {_leaf_fix(around, modules)}")
    return ""


def _written_cause(ref: Reference) -> str:
    if not ref.written:
        return ""
    i, r, name = ref.written[0]
    return (f"param {name!r} changed during a forward and backward in one process (micro-step {i}, rank {r}'s "
            "slice): an in-place write outside autograd (under torch.no_grad(), or through .data). Under fz3 "
            "that write goes into a gathered copy that is freed after use, so it is lost (and each rank writes "
            "its own). Make it a buffer (register_buffer: rank 0's is broadcast before each forward), or change "
            "it between steps inside fz3.gathered_parameters(param, modifier_rank=0)")


def _warnings(ex: Example, ref: Reference, ranks, modules, broadcast: bool) -> list[str]:
    out = []
    first = ranks[0]
    for i in sorted(first.entered):
        if i and first.entered[i] != first.entered[0]:
            k, x, y, around = _order_difference(first, 0, first, i)
            out.append(f"the module order depends on the data: micro-step {i}'s call {k} entered {y!r} where "
                       f"micro-step 0's entered {x!r}. fz3 records the order again at each change and does not "
                       f"prefetch meanwhile (engine.stats()['trace_invalidations']); {_leaf_fix(around, modules)}")
            break
    if ref.written:
        out.append(_written_cause(ref))
    if ref.updated and broadcast and ex.world_size > 1:
        out.append(f"buffers updated in forward ({', '.join(ref.updated[:4])}): on several ranks every forward "
                   "starts from rank 0's (Options(broadcast_buffers=True), DDP's rule), so they follow rank 0's "
                   "slices, not the whole batch")
    if ref.skipped:
        out.append(f"the gradient norm was not finite at step(s) {ref.skipped} in one process too: those steps "
                   "were skipped on both sides (fz3 skips them); the losses after it say little")
    return out
