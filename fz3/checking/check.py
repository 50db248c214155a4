"""fz3.check: does *this* model train the same on N ranks as on one, under the configs around the
user's, and does anything in it break that? (issue #28)

    report = fz3.check(build)                  # fz3/api.py: the public signature
    assert report.ok, report.summary()
    python -m fz3 check mymodule:build [--world-sizes 1,2,3] [--examples N] [--steps K] ...

    build() -> (model, example_batches, loss_fn) | (model, example_inputs)   (build.py)
        |
        take, size guard, one forward and backward in one process (bad input: CheckInputError)
        |
    examples: the user's config at each world size, then drawn ones     (draw.py)
        |  for each example
        v
    reference in one process, fz3's arithmetic (memoised per world size, gas, dtypes)
    fz3.initialize on W thread ranks, every core event watched (I1, I2, effects)  (run.py,
    the same again (determinism); after a failure without a known cause, once     watch.py)
    more with every torch call watched (a read of a param fz3 had released)
        |
    compare: losses, params, buffers, I1, I2, determinism, divergence, errors   (compare.py)
        |  a failing example
        v
    shrink: greedy to a fixed point, each field back to the user's, fewer ranks, fewer steps
        |
    CheckReport: per example pass / the first failure, its cause, the smallest failing config
                 as fz3.Config(...) to paste; warnings; what was not checked   (report.py)

[Note: tolerance] fp32 compares with rtol 1e-5 (the issue's bound) and atol 1e-6 (a param that
ends near zero keeps an absolute error of a few ulps of its largest grad term; tests/test_parity.py
says why) by default, and reports whether an example matched bit for bit, as 1 and 2 ranks do:
the reference does fz3's arithmetic in fz3's order (run.py [Note: the check's reference]),
so a deviation comes only from the order in which a reduce adds 3 or more ranks. bf16 compute
is drawn only when asked (`bf16=True`, `--bf16`) or when the user's config computes in bf16:
a model may not run in bf16 on the CPU, or may not be meant to. Its reference computes in bf16
too; bf16 keeps 8 significant bits, so where a reduce adds the ranks in another order a grad
moves by an ulp, 4e-3 of it, and at least rtol 2e-2, atol 6e-3 apply (the parity suite's bf16
bounds).

The default optimizer is SGD with momentum (lr 1e-2, momentum 0.9): Adam's first steps move a
param by lr * sign(grad), so a grad that is zero up to rounding moves by a whole lr on one side
and not the other, and Adam hides a wrongly scaled grad; the parity suite checks with SGD for
both reasons. "adamw", "adam" or a callable(params) -> optimizer choose another.
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Union

import torch

from fz3.config.config import Config
from fz3.config.options import Options
from fz3.checking.build import (CheckInputError, Subject, check_model, copies, divides, estimate_bytes,
                                     loss_backward, numels, rank_batch, take)
from fz3.checking.compare import Compared, Tolerance, compare, first_error
from fz3.checking.draw import Example, Space, draw, shrink
from fz3.checking.report import CheckReport, ExampleResult, Failure
from fz3.checking.run import Job, Reference, cast_floating, on_ranks, reference, seed_for

OPTIMIZERS: dict[str, Callable] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
}
BF16_FLOOR = (2e-2, 6e-3)  # rtol, atol at least, with bf16 compute ([Note: tolerance])
MEMORY_LIMIT = 20 * 2**30  # bytes the check may hold on one machine


@dataclass(frozen=True)
class Settings:
    """How fz3.check runs (fz3.check's keywords; python -m fz3 check's flags)."""

    world_sizes: tuple[int, ...] = (1, 2, 3)
    examples: int = 12
    steps: int = 2
    config: Config = field(default_factory=Config)
    seed: int = 0
    options: Options = field(default_factory=Options)
    optimizer: Union[str, Callable] = "sgd"
    rtol: float = 1e-5
    atol: float = 1e-6
    bf16: bool = False
    memory_limit: int = MEMORY_LIMIT
    timeout_s: float = 600.0

    def validate(self) -> None:
        ws = self.world_sizes
        if not isinstance(ws, (tuple, list)) or not ws or any(
                isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in ws):
            raise CheckInputError(f"world_sizes must be a non-empty list of ints >= 1, got {ws!r}")
        for name in ("examples", "steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise CheckInputError(f"{name} must be an int >= 1, got {v!r}")
        if not isinstance(self.config, Config):
            raise CheckInputError(f"config must be a fz3.Config (fz3.Config.from_deepspeed for a DeepSpeed dict), "
                                  f"got {type(self.config).__name__}")
        if not isinstance(self.options, Options):
            raise CheckInputError(f"options must be a fz3.Options, got {type(self.options).__name__}")
        if not callable(self.optimizer) and self.optimizer not in OPTIMIZERS:
            raise CheckInputError(f"optimizer must be one of {', '.join(OPTIMIZERS)} or a callable that builds a "
                                  f"torch optimizer from params, got {self.optimizer!r}")
        for name in ("rtol", "atol"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise CheckInputError(f"{name} must be a number >= 0, got {v!r}")

    def make_optimizer(self) -> Callable:
        return OPTIMIZERS[self.optimizer] if isinstance(self.optimizer, str) else self.optimizer

    def optimizer_name(self) -> str:
        return self.optimizer if isinstance(self.optimizer, str) else getattr(self.optimizer, "__name__", "callable")

    def tolerance(self, compute_dtype: str) -> Tolerance:
        if compute_dtype == "bf16":
            return Tolerance(max(self.rtol, BF16_FLOOR[0]), max(self.atol, BF16_FLOOR[1]))
        return Tolerance(self.rtol, self.atol)


def check(build: Callable[[], tuple], settings: Settings, *, initialize: Callable) -> CheckReport:
    """Run fz3.check (the module doc). `initialize`: fz3.initialize, passed down from fz3/api.py
    (features sit below the entry points). Bad input raises CheckInputError, naming what was
    expected; everything the check finds is in the report."""
    with _quiet_log_one_thread():
        return _check(build, settings, initialize)


@contextlib.contextmanager
def _quiet_log_one_thread():
    """While the check runs: fz3's own WARNINGs (the module order changed, own buffers, a skipped
    step) stay out of its output, the report says what they would, once, with the example; and
    torch computes on one intra-op thread, as each thread rank does (run_threads), so the
    reference's kernels are the ranks' and the comparisons do not wait on a busy thread pool."""
    drop = lambda record: record.levelno >= logging.ERROR  # noqa: E731
    logger = logging.getLogger("fz3")
    logger.addFilter(drop)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        logger.removeFilter(drop)
        torch.set_num_threads(threads)


def _check(build: Callable[[], tuple], settings: Settings, initialize: Callable) -> CheckReport:
    start = time.perf_counter()
    settings.validate()
    subject = take(build)
    numel = sum(numels(subject.model))
    _guard_size(subject, numel, settings)
    check_model(subject.model)
    _smoke(subject, settings, torch.float32)
    space, bf16, skipped = _space(subject, settings)
    runner = Runner(subject, settings, initialize)
    results = []
    for k, ex in enumerate(draw(space, settings.seed, settings.examples)):
        results.append(_result(k, ex, runner, space))
    undecided = _undecided(settings, results, runner)
    notes = [f"passed whole to every rank (not split by rows): {', '.join(subject.whole)}"] if subject.whole else []
    return CheckReport(
        model=type(subject.model).__name__, params=numel, base=settings.config,
        world_sizes=tuple(settings.world_sizes), steps=settings.steps, seed=settings.seed,
        optimizer=settings.optimizer_name(),
        tolerance={d: (settings.tolerance(d).rtol, settings.tolerance(d).atol) for d in ("fp32", "bf16")[:1 + bf16]},
        results=tuple(results), warnings=tuple(dict.fromkeys(runner.warnings)), skipped=tuple(skipped),
        undecided=tuple(undecided), derived_loss=subject.derived, seconds=time.perf_counter() - start,
        notes=tuple(notes))


def _undecided(settings: Settings, results: list[ExampleResult], runner: "Runner") -> list[str]:
    """What the examples cannot say ("never a silent pass")."""
    out = []
    if any(w > 1 for w in settings.world_sizes) and not any(r.example.world_size > 1 for r in results):
        out.append("no example ran on more than one rank, so nothing checked sharding across ranks: give more "
                   "examples or batches whose size divides by a world size > 1")
    for (world, gas, dtype, *_), ref in sorted(runner.references.items(), key=lambda kv: repr(kv[0])):
        bad = next((i for i, row in enumerate(ref.losses) if not all(math.isfinite(x) for x in row)), None)
        if bad is not None:
            out.append(f"the loss is not finite in one process (W={world}, gradient_accumulation_steps={gas}, "
                       f"{dtype}, micro-step {bad}): equal NaNs say nothing; lower the learning rate or fix the "
                       "model's numbers")
            break
    return out


def _space(subject: Subject, settings: Settings) -> tuple[Space, bool, list[str]]:
    """What may be drawn: the world sizes the batches divide, bf16 if asked and the model runs in
    it; -> (space, bf16 drawn, what is not checked and why)."""
    skipped = []
    bf16 = settings.bf16 or settings.config.compute_dtype == "bf16"
    if bf16:
        why = _bf16_trouble(subject, settings)
        if why and settings.config.compute_dtype == "bf16":
            raise CheckInputError(f"your config computes in bf16, and the model does not run in bf16 here: {why}")
        if why:
            skipped.append(f"bf16 compute: the model does not run in bf16 on the CPU ({why})")
            bf16 = False
    worlds = [w for w in sorted(set(settings.world_sizes)) if divides(subject, w)]
    for w in sorted(set(settings.world_sizes) - set(worlds)):
        skipped.append(f"W={w}: the batches' sizes {sorted(set(subject.rows))} do not divide among {w} ranks "
                       "(each rank takes an equal slice of dim 0)")
    if not worlds:
        raise CheckInputError(f"no world size in {list(settings.world_sizes)} divides the batches' sizes "
                              f"{sorted(set(subject.rows))}: give batches whose dim 0 divides by the world sizes")
    return Space.around(settings.config, worlds, settings.steps, numels(subject.model), bf16=bf16), bf16, skipped


def _result(k: int, ex: Example, runner: "Runner", space: Space) -> ExampleResult:
    got = runner.outcome(ex)
    shrunk, shrunk_failures = None, ()
    if got.failures:
        steps = [f.step for f in got.failures if f.step is not None]
        shrunk = shrink(ex, space, lambda e: bool(runner.outcome(e).failures), first_step=min(steps, default=None))
        shrunk_failures = tuple(runner.outcome(shrunk.example).failures)
    return ExampleResult(k, ex, tuple(got.failures), got.exact, got.loss_dev, got.param_dev, shrunk,
                         shrunk_failures)


class Runner:
    """Runs examples and remembers each outcome (shrinking revisits them) and each reference (it
    depends on the world size, gas and dtypes only)."""

    def __init__(self, subject: Subject, settings: Settings, initialize: Callable) -> None:
        self.subject, self.settings, self.initialize = subject, settings, initialize
        self.modules = [(name, type(m)) for name, m in subject.model.named_modules()]
        self.outcomes: dict[Example, Compared] = {}
        self.references: dict[tuple, Reference] = {}
        self.warnings: list[str] = []

    def job(self, ex: Example, **changes) -> Job:
        s = self.settings
        job = Job(ex.world_size, ex.steps, ex.config, s.options, s.make_optimizer(), s.seed, self.initialize,
                  s.timeout_s)
        return replace(job, **changes)

    def reference(self, ex: Example) -> Reference:
        c = ex.config
        key = (ex.world_size, c.gradient_accumulation_steps, c.compute_dtype, c.communication_data_type,
               c.gradient_clipping)
        if key not in self.references:
            self.references[key] = reference(self.subject, self.job(ex, steps=self.settings.steps))
        return self.references[key]

    def outcome(self, ex: Example) -> Compared:
        if ex in self.outcomes:
            return self.outcomes[ex]
        ref = self.reference(ex)
        tol = self.settings.tolerance(ex.config.compute_dtype)
        broadcast = self.settings.options.broadcast_buffers
        try:
            ranks = on_ranks(self.subject, self.job(ex))
            again = on_ranks(self.subject, self.job(ex)) if first_error(ranks) is None else None
            got = compare(ex, ref, ranks, again, tol, self.modules, broadcast)
            if _unexplained(got):  # once more, every torch call watched for a read of a released param
                diagnosis = _error_of(on_ranks(self.subject, self.job(ex, diagnose=True)))
                if diagnosis is not None:
                    got = compare(ex, ref, ranks, again, tol, self.modules, broadcast, diagnosis)
        except TimeoutError as e:
            got = Compared(failures=(Failure("error", ex, f"{e}: a rank never finished (a model waiting on "
                                             "something of its own, or a hang)"),), exact=False)
        self.warnings.extend(got.warnings)
        self.outcomes[ex] = got
        return got


def _unexplained(got: Compared) -> bool:
    """A numbers failure or an error (not a divergence) without a recognised cause, or two runs
    that differ: worth the diagnosis run (run.ReleasedReads; a read of a param's
    placeholder reads whatever its memory holds, so it differs from run to run too)."""
    return any((f.check in ("losses", "params", "error") and not f.cause) or f.check == "determinism"
               for f in got.failures)


def _error_of(ranks) -> BaseException | None:
    first = first_error(ranks)
    return None if first is None else first.error


def _guard_size(subject: Subject, numel: int, settings: Settings) -> None:
    """Refuse, before copying anything, a model whose check would hold more than the limit."""
    references = len(set(settings.world_sizes)) * 2 * (2 if settings.bf16 else 1)  # W x gas 1, 2 x dtypes
    need = estimate_bytes(numel, max(settings.world_sizes), settings.steps, references)
    if need > settings.memory_limit:
        gib = 2**30
        raise CheckInputError(
            f"the model is too big to check in one process here: {numel:,} params need about {need / gib:.1f} GiB "
            f"on up to {max(settings.world_sizes)} ranks (fp32 copies for the reference, every rank's model and "
            f"shards, the params after each step; activations not counted), over the {settings.memory_limit / gib:g}"
            f" GiB fz3.check allows itself. Plan the run instead, with no memory for the params: python -m fz3 plan "
            "MODULE:FUNCTION --world-size N (fz3.plan), or check a smaller model of the same code (fewer layers)")


def _smoke(subject: Subject, settings: Settings, dtype: torch.dtype) -> None:
    """One forward and backward of example batch 0 in one process on a copy: the model runs on
    the CPU and loss_fn returns a scalar loss that requires grad (else CheckInputError)."""
    twin = copies(subject.model, 1)[0]
    how = "model(*example_inputs)" if subject.derived else "loss_fn(model, example_batches[0])"
    if dtype != torch.float32:
        twin.to(dtype)
        twin.register_forward_pre_hook(lambda m, a, k: cast_floating((a, k), dtype), with_kwargs=True)
    rng = torch.get_rng_state()
    torch.manual_seed(seed_for(settings.seed, 0, 0))
    try:
        loss_backward(subject.loss_fn, twin, rank_batch(subject.batches[0], subject.rows[0], 0, 1), how,
                      f"the model does not run in one process on the CPU: {how} raised")
    finally:
        torch.set_rng_state(rng)


def _bf16_trouble(subject: Subject, settings: Settings) -> str:
    """'' if the model runs a forward and backward in bf16 here, else what went wrong."""
    try:
        _smoke(subject, settings, torch.bfloat16)
    except CheckInputError as e:
        return str(e).split(": ", 1)[-1]
    return ""

