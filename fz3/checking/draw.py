"""fz3.check's examples: which configs and world sizes it draws, and how a failure shrinks.

    space = Space.around(base, world_sizes, steps, numels, bf16=False)
    examples = draw(space, seed=0, count=12)        # the same seed, the same examples
    neighbours(example, space)                     # every one-step-simpler example
    shrink(example, space, fails)                  # greedy to a fixed point -> Shrunk
    config_source(config)                          # "fz3.Config(reduce_bucket_size=7)": eval-able

An example is (world size, optimizer steps, Config). The first examples are the user's own
config at each world size, smallest first; the rest draw each field of FIELDS independently:
kept at the user's value half the time, else one of its alternatives, which are scaled to the
model's own param sizes (`Space.around`), so any model meets the regimes that change what fz3
does: nothing persistent and everything persistent, no prefetch and prefetch of everything, a
live budget of nothing, reuse off, a reduce bucket of one element, the other reduce path,
gradient accumulation, bf16 compute (only where allowed: fz3/checking/check.py says when).

    example k:   W = world_sizes[k % len]      config = the user's (k < len(world_sizes))
                                                         or drawn from Random("fz3.check:seed:k")

[Note: drawing with random.Random] Hypothesis is in the `test` extra, not a runtime dependency,
and what fz3.check needs of it is little: a seeded draw of a few independent fields, and a
shrink whose result can be checked. Hypothesis shrinks toward the smallest choice sequence, a
notion of "simpler" the user cannot see or check; here "simpler" is a rule anyone can state and
test: each field back to the user's value, fewer ranks, fewer steps. So examples are drawn with
random.Random seeded by a string (Python hashes str seeds with sha512: the same on every
machine and every PYTHONHASHSEED), each example by its own seed, so example k is the same
whatever the number of examples asked for.

[Note: the shrinking rule] The one-step-simpler neighbours of (W, K, config), in the order tried:
every smaller world size allowed (smallest first), every drawn field set back to the user's
value (in Config's field order), and K - 1 steps. `shrink` moves to the first neighbour that
still fails and starts again, until none fails: a fixed point, so the example it returns fails
and every one of its neighbours passes, by construction (tests/test_check.py runs them all).
A run's first K - 1 steps are the whole of the run with K - 1 steps, so a failure first seen at
step s shrinks straight to s steps before the search starts. The search is greedy: another
order could reach another local minimum, never a failing neighbour of the one returned.
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Callable, Sequence

from fz3.config.config import Config, differences

FIELDS = ("param_persistence_threshold", "max_live_parameters", "prefetch_bucket_size", "max_reuse_distance",
          "reduce_bucket_size", "contiguous_gradients", "reduce_scatter", "overlap_comm",
          "gradient_accumulation_steps", "compute_dtype")
"""The Config fields fz3.check draws, in Config's order (the order shrinking tries them)."""


@dataclass(frozen=True)
class Example:
    """One run to compare: `steps` optimizer steps on `world_size` thread ranks under `config`."""

    world_size: int
    steps: int
    config: Config

    def changes(self, base: Config) -> str:
        """'param_persistence_threshold=0, ...': the drawn fields that differ from the user's."""
        return ", ".join(f"{k}={getattr(self.config, k)!r}" for k in drawn_fields(self.config, base)) or "your config"

    def describe(self, base: Config) -> str:
        """'W=2, 3 steps, param_persistence_threshold=0'."""
        return f"W={self.world_size}, {self.steps} step{'s' if self.steps != 1 else ''}, {self.changes(base)}"


@dataclass(frozen=True)
class Space:
    """What may be drawn: the user's config, the world sizes that can run (ascending), the steps
    asked for, and per drawn field the alternatives to the user's value."""

    base: Config
    world_sizes: tuple[int, ...]
    steps: int
    choices: tuple[tuple[str, tuple], ...]  # (field, alternatives), in FIELDS order

    @classmethod
    def around(cls, base: Config, world_sizes: Sequence[int], steps: int, numels: Sequence[int], *,
               bf16: bool) -> "Space":
        """Alternatives scaled to the model: its smallest, middle and largest param and its total
        numel. `bf16`: compute_dtype may be drawn (fp32 when the user's is bf16)."""
        sizes = sorted(n for n in numels if n > 0) or [1]
        small, mid, big, total = sizes[0], sizes[len(sizes) // 2], sizes[-1], sum(sizes)
        alternatives = {
            "param_persistence_threshold": (0, mid, big),  # none, the smaller half, all persistent
            "max_live_parameters": (0, big, max(1, total // 2)),
            "prefetch_bucket_size": (0, small, mid, total),
            "max_reuse_distance": (0, mid, total),
            "reduce_bucket_size": (1, mid, total),
            "contiguous_gradients": (True, False),
            "reduce_scatter": (True, False),
            "overlap_comm": (True, False),
            "gradient_accumulation_steps": (1, 2),
            "compute_dtype": ("fp32", "bf16") if bf16 or base.compute_dtype == "bf16" else (),
        }
        choices = []
        for name in FIELDS:
            own = getattr(base, name)
            alts = tuple(sorted({a for a in alternatives[name] if a != own}, key=repr))
            if alts:
                choices.append((name, alts))
        return cls(base, tuple(sorted(set(world_sizes))), steps, tuple(choices))


def drawn_fields(config: Config, base: Config) -> list[str]:
    """The drawn fields where `config` differs from `base`, in FIELDS order."""
    return [name for name in FIELDS if getattr(config, name) != getattr(base, name)]


def draw(space: Space, seed: int, count: int) -> list[Example]:
    """`count` examples (see the module doc): the user's config at each world size first."""
    out = []
    for k in range(count):
        world = space.world_sizes[k % len(space.world_sizes)]
        config = space.base if k < len(space.world_sizes) else _drawn_config(space, seed, k)
        out.append(Example(world, space.steps, config))
    return out


def _drawn_config(space: Space, seed: int, k: int) -> Config:
    rng = random.Random(f"fz3.check:{seed}:{k}")
    changes = {}
    for name, alts in space.choices:
        if rng.random() < 0.5:
            changes[name] = rng.choice(alts)
    return space.base.replace(**changes)


def neighbours(example: Example, space: Space) -> list[Example]:
    """Every one-step-simpler example ([Note: the shrinking rule]), in the order shrink tries them."""
    out = [dataclasses.replace(example, world_size=w) for w in space.world_sizes if w < example.world_size]
    for name in drawn_fields(example.config, space.base):
        out.append(dataclasses.replace(example, config=example.config.replace(**{name: getattr(space.base, name)})))
    if example.steps > 1:
        out.append(dataclasses.replace(example, steps=example.steps - 1))
    return out


@dataclass(frozen=True)
class Shrunk:
    example: Example  # fails; every neighbour passes (when minimal)
    runs: int  # examples run while shrinking
    minimal: bool  # False: the budget of runs ran out first (the example still fails)


def shrink(example: Example, space: Space, fails: Callable[[Example], bool], *, first_step: int | None = None,
           budget: int = 60) -> Shrunk:
    """Greedy to a fixed point ([Note: the shrinking rule]). `fails(example)` runs it; `example`
    is known to fail, first at optimizer step `first_step` when known; `budget` bounds the runs."""
    runs = 0
    if first_step is not None and 1 <= first_step < example.steps:
        shorter = dataclasses.replace(example, steps=first_step)
        runs += 1
        if fails(shorter):
            example = shorter
    while True:
        for candidate in neighbours(example, space):
            if runs >= budget:
                return Shrunk(example, runs, minimal=False)
            runs += 1
            if fails(candidate):
                example = candidate
                break
        else:
            return Shrunk(example, runs, minimal=True)


def config_source(config: Config) -> str:
    """`fz3.Config(...)` with the fields that differ from DeepSpeed's defaults: valid Python
    that evaluates (with `import fz3`) to `config`."""
    return "fz3.Config(" + ", ".join(f"{k}={v!r}" for k, v in differences(config).items()) + ")"
