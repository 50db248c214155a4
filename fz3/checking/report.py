"""fz3.check's answer: what failed, where, why it likely did, and the smallest example that fails.

    report.ok              no failure, and nothing left undecided
    report.failures        the failures of the shrunk examples (each the smallest that fails)
    report.results         per example: its failures, how close its numbers were, its shrink
    report.summary()       the text `python -m fz3 check` prints

A failure names its check (the table in docs/check.md), the optimizer step (from 1) and micro-step (from 0), the
rank, the param, buffer or module, the values, and its example (world size, steps, config);
`cause` is the likely cause when the failure has a signature fz3.check recognises.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from fz3.config.config import Config
from fz3.checking.draw import Example, Shrunk, config_source

@dataclass(frozen=True)
class Failure:
    check: str  # one of docs/check.md's checks
    example: Example
    detail: str  # what differs, with the values
    step: Optional[int] = None  # optimizer step, from 1
    micro_step: Optional[int] = None  # from 0, counted over the run
    rank: Optional[int] = None
    name: Optional[str] = None  # the param, buffer or module
    cause: str = ""  # the likely cause, when recognised

    def where(self) -> str:
        parts = []
        if self.step is not None:
            parts.append(f"step {self.step}" + (f" (micro-step {self.micro_step})" if self.micro_step is not None
                                                else ""))
        if self.rank is not None:
            parts.append(f"rank {self.rank}")
        if self.name is not None:
            parts.append(repr(self.name))
        return ", ".join(parts)

    def describe(self) -> str:
        """'check: step s (micro-step i), rank r, 'name': detail' (the cause apart)."""
        where = self.where()
        return f"{self.check}: {where + ': ' if where else ''}{self.detail}"

    def __str__(self) -> str:
        ex = self.example
        text = (f"{self.describe()}\n  on W={ex.world_size}, {ex.steps} step{'s' if ex.steps != 1 else ''}, "
                f"{config_source(ex.config)}")
        return text + (f"\n  likely cause: {self.cause}" if self.cause else "")


@dataclass(frozen=True)
class ExampleResult:
    index: int
    example: Example
    failures: tuple[Failure, ...]
    exact: bool  # every loss and param compared equal bit for bit
    loss_dev: float  # largest relative deviation of a loss
    param_dev: float  # largest absolute deviation of a param element
    shrunk: Optional[Shrunk] = None
    shrunk_failures: tuple[Failure, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.failures

    def verdict(self) -> str:
        if self.failures:
            return "FAIL " + ", ".join(dict.fromkeys(f.check for f in self.failures))
        if self.exact:
            return "pass, bit for bit"
        losses = f"losses {self.loss_dev:.0e} rel" if self.loss_dev else "losses exact"
        return f"pass, {losses}, params {self.param_dev:.0e} abs"


@dataclass(frozen=True)
class CheckReport:
    model: str  # the model's class
    params: int  # its elements (a tied param once)
    base: Config  # the user's config
    world_sizes: tuple[int, ...]  # asked for
    steps: int
    seed: int
    optimizer: str
    tolerance: dict[str, tuple[float, float]]  # compute dtype -> (rtol, atol)
    results: tuple[ExampleResult, ...]
    warnings: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()  # what was not run, and why
    undecided: tuple[str, ...] = ()  # what the check could not decide: never a silent pass
    derived_loss: bool = False
    seconds: float = 0.0
    notes: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return not self.failures and not self.undecided

    @property
    def failures(self) -> tuple[Failure, ...]:
        """The failures of every failing example's shrunk example (its own when not shrunk),
        each once."""
        seen: dict = {}
        for r in self.results:
            for f in (r.shrunk_failures or r.failures):
                seen.setdefault((f.check, f.example, f.name, f.step, f.rank), f)
        return tuple(seen.values())

    def summary(self) -> str:
        return "\n".join(_lines(self))

    def __str__(self) -> str:
        return self.summary()


def _failures(failures) -> list[str]:
    """Each failure on a line, then each distinct likely cause once."""
    out = ["  " + f.describe().replace("\n", "\n  ") for f in failures]
    for cause in dict.fromkeys(f.cause for f in failures if f.cause):
        out.append(f"  likely cause: {cause}")
    return out


def _lines(rep: CheckReport) -> list[str]:
    tol = "; ".join(f"{k}: rtol {r:g}, atol {a:g}" for k, (r, a) in rep.tolerance.items())
    out = [f"fz3 check: {rep.model}, {rep.params:,} params; {len(rep.results)} examples on world sizes "
           f"{', '.join(map(str, rep.world_sizes))}, {rep.steps} step{'s' if rep.steps != 1 else ''} each; "
           f"seed {rep.seed}; optimizer {rep.optimizer}; {rep.seconds:.1f} s",
           f"your config: {config_source(rep.base)}",
           f"checks: losses and params against one process ({tol}), buffers, I1 live budget, prefetch reach, "
           "I2 counts, determinism (each example run twice), divergence"
           + ("; the loss: derived from the output (build() gave example_inputs)" if rep.derived_loss else ""),
           "", f"{'#':>3}  {'W':>2}  {'steps':>5}  {'result':<40}  config (fields that differ from yours)"]
    for r in rep.results:
        ex = r.example
        out.append(f"{r.index:>3}  {ex.world_size:>2}  {ex.steps:>5}  {r.verdict():<40}  {ex.changes(rep.base)}")
    failing = [r for r in rep.results if r.failures]
    out.append("")
    shown: dict = {}  # shrunk example -> the first example shrunk to it
    for r in failing:
        out.append(f"example {r.index} ({r.example.describe(rep.base)}):")
        out.extend(_failures(r.failures))
        if r.shrunk is None:
            continue
        s = r.shrunk
        if s.example in shown:
            out.append(f"  smallest failing example: the same as example {shown[s.example]}'s")
            continue
        shown[s.example] = r.index
        how = ("every one-step-simpler example passes" if s.minimal else
               "shrinking stopped at its budget of runs: it fails, but a simpler one may too")
        out.append(f"  smallest failing example, shrunk in {s.runs} runs ({how}): W={s.example.world_size}, "
                   f"{s.example.steps} step{'s' if s.example.steps != 1 else ''},")
        out.append(f"    {config_source(s.example.config)}")
        own = {(f.check, f.detail) for f in r.failures}
        if any((f.check, f.detail) not in own for f in r.shrunk_failures):
            out.append("  where it fails with:")
            out.extend("  " + line for line in _failures(r.shrunk_failures))
    for title, items in (("warnings", rep.warnings), ("not checked", rep.skipped),
                         ("undecided", rep.undecided), ("notes", rep.notes)):
        if items:
            out.append(f"{title}:")
            out.extend(f"  - {w}" for w in items)
    if failing:
        out.append(f"FAILED: {len(failing)} of {len(rep.results)} examples")
    elif rep.undecided:
        out.append(f"UNDECIDED: {len(rep.undecided)} thing(s) could not be checked (above)")
    else:
        out.append(f"OK: {len(rep.results)} examples passed")
    return out
