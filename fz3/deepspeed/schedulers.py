"""DeepSpeed's JSON "scheduler" section as torch LRSchedulers: WarmupLR, WarmupDecayLR,
WarmupCosineLR, OneCycle and LRRangeTest, with DeepSpeed 0.19.8's parameter names, defaults,
and learning rate (and OneCycle's betas) at every step, per param group.

    scheduler = build_scheduler({"type": "WarmupLR", "params": {...}}, optimizer)
    optimizer.step(); scheduler.step()      # once per applied step, as DeepSpeed's engine does

[Note: counting] DeepSpeed counts `last_batch_iteration`: -1 after construction, +1 per step().
torch's LRScheduler counts `last_epoch` and steps once in its constructor, so here
last_batch_iteration = last_epoch - 1, and each schedule is a closed form `lrs(i)` of it:

    construct --> i = -1: lrs(-1) written into the param groups (DeepSpeed sets them at
        |                 construction: WarmupLR warmup_min_lr, WarmupCosineLR 0.0,
        | step()          OneCycle cycle_min_lr and cycle_min_mom, LRRangeTest its min lr)
        v
    i = 0, 1, 2, ... : lrs(i)

so optimizer step k (from 1) runs at lrs(k - 2): the first two steps of a WarmupLR or
WarmupDecayLR both run at warmup_min_lr, the first of a WarmupCosineLR at lr 0.0. state_dict() is
torch's (every attribute); load_state_dict also takes DeepSpeed's {"last_batch_iteration": i}.
Departures: an unknown warmup_type, and cycle_momentum true on an optimizer without betas, are
errors (DeepSpeed warns and does something else); a "type" DeepSpeed would find in
torch.optim.lr_scheduler is an error naming it (build that scheduler and pass it instead).
DeepSpeed: runtime/lr_schedules.py, runtime/engine.py _scheduler_from_config.
"""
from __future__ import annotations

import inspect
import logging
import math
from typing import Mapping, Optional, Sequence, Union

import torch
from torch.optim.lr_scheduler import LRScheduler

from fz3.deepspeed.optimizers import check_params, read_section

LOG = logging.getLogger("fz3")
PerGroup = Union[float, Sequence[float]]
WARMUP_TYPES = ("log", "linear")


class DeepSpeedSchedule(LRScheduler):
    """A DeepSpeed schedule on torch's LRScheduler: subclasses give `lrs(i)` for DeepSpeed's
    iteration i ([Note: counting]) and set their fields before calling this constructor, which
    writes lrs(-1) into the groups. `last_batch_iteration` is DeepSpeed's, and only -1 (a fresh
    schedule) is taken: a resumed one comes back through load_state_dict."""

    def __init__(self, optimizer: torch.optim.Optimizer, last_batch_iteration: int = -1) -> None:
        if last_batch_iteration != -1:
            raise ValueError(f"{type(self).__name__}: last_batch_iteration = {last_batch_iteration!r}: fz3 starts "
                             "schedules at -1 (a fresh one); resume one with load_state_dict")
        super().__init__(optimizer)

    @property
    def last_batch_iteration(self) -> int:
        return self.last_epoch - 1

    def lrs(self, iteration: int) -> list[float]:
        raise NotImplementedError

    def get_lr(self) -> list[float]:
        return self.lrs(self.last_epoch - 1)

    def step(self, last_batch_iteration: Optional[int] = None) -> None:
        """The next iteration, or `last_batch_iteration` itself when given (DeepSpeed's step)."""
        if last_batch_iteration is not None:
            self.last_epoch = last_batch_iteration  # torch's step adds the 1
        super().step()

    def load_state_dict(self, state_dict: Mapping[str, object]) -> None:
        if set(state_dict) == {"last_batch_iteration"}:  # DeepSpeed's own scheduler state
            state_dict = {"last_epoch": int(state_dict["last_batch_iteration"]) + 1}
        super().load_state_dict(dict(state_dict))


def per_group(optimizer: torch.optim.Optimizer, value: PerGroup, key: str) -> list[float]:
    """One value per param group: a scalar for all, or a list with one per group.
    DeepSpeed: runtime/lr_schedules.py _format_param."""
    n = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"DeepSpeed scheduler parameter {key!r} = {value!r}: expected {n} values, one per "
                             f"param group, or one number for all")
        return list(value)
    return [value] * n


def group_lrs(optimizer: torch.optim.Optimizer) -> list[float]:
    return [float(group["lr"]) for group in optimizer.param_groups]


def positive_int(key: str, value: object) -> int:
    """A positive int; an integral float too (10.0): DeepSpeed refuses one in a dict config but
    reads a JSON file with hjson, which makes 10.0 the int 10."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"DeepSpeed scheduler parameter {key!r} = {value!r}: must be a positive integer")
    return value


def number(key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"DeepSpeed scheduler parameter {key!r} = {value!r}: expected a number")
    return value


def check_warmup_type(value: object) -> str:
    """'log' or 'linear'. DeepSpeed warns on any other and warms up with 'log'; fz3 refuses,
    since a misspelt 'Linear' would otherwise change the schedule. DeepSpeed: WarmupLR.__init__."""
    if value not in WARMUP_TYPES:
        raise ValueError(f"DeepSpeed scheduler parameter 'warmup_type' = {value!r}: expected one of "
                         f"{', '.join(WARMUP_TYPES)} (DeepSpeed 0.19.8 falls back to 'log' with a warning)")
    return value


def warmup_fraction(kind: str, iteration: int, num_steps: int) -> float:
    """0 at iteration 0, rising to 1 at iteration num_steps - 1 (log) or num_steps (linear).
    DeepSpeed: WarmupLR._get_gamma, WarmupCosineLR.get_lr_ratio."""
    if kind == "log":
        return 1.0 / math.log(num_steps) * math.log(iteration + 1)
    return iteration / num_steps


class WarmupLR(DeepSpeedSchedule):
    """From warmup_min_lr to warmup_max_lr over warmup_num_steps iterations, then flat.
    warmup_max_lr defaults to each group's own lr (WarmupDecayLR's to 0.001, null there meaning
    the groups' lrs); a number given replaces every group's own lr. warmup_num_steps below 2
    counts as 2. DeepSpeed: runtime/lr_schedules.py WarmupLR."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_min_lr: PerGroup = 0.0,
                 warmup_max_lr: Optional[PerGroup] = None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        warmup_num_steps = positive_int("warmup_num_steps", warmup_num_steps)
        if warmup_max_lr is None:
            warmup_max_lr = group_lrs(optimizer)
        self.min_lrs = per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.delta_lrs = [big - small for big, small in zip(self.max_lrs, self.min_lrs)]
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = check_warmup_type(warmup_type)
        super().__init__(optimizer, last_batch_iteration)

    def lrs(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_lrs)
        gamma = self.gamma(iteration)
        return [min_lr + (delta_lr * gamma) for min_lr, delta_lr in zip(self.min_lrs, self.delta_lrs)]

    def gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return warmup_fraction(self.warmup_type, iteration, self.warmup_num_steps)
        return 1.0


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear from warmup_max_lr at iteration warmup_num_steps down to
    warmup_min_lr (not 0) at iteration total_num_steps, and flat there.
    DeepSpeed: runtime/lr_schedules.py WarmupDecayLR."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_lr: PerGroup = 0.0,
                 warmup_max_lr: Optional[PerGroup] = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        self.total_num_steps = number("total_num_steps", total_num_steps)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)

    def gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return warmup_fraction(self.warmup_type, iteration, self.warmup_num_steps)
        return max(0.0, float(self.total_num_steps - iteration) /
                   float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(DeepSpeedSchedule):
    """Each group's own lr (at construction) times a ratio: warmup_min_ratio rising to 1 over
    warmup_num_steps, then a cosine down to cos_min_ratio at total_num_steps, flat after. The
    lr after construction is 0.0, not warmup_min_ratio * lr.
    DeepSpeed: runtime/lr_schedules.py WarmupCosineLR."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        warmup_num_steps = positive_int("warmup_num_steps", warmup_num_steps)
        self.total_num_steps = number("total_num_steps", total_num_steps)
        self.warmup_min_ratio = number("warmup_min_ratio", warmup_min_ratio)
        self.cos_min_ratio = number("cos_min_ratio", cos_min_ratio)
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = check_warmup_type(warmup_type)
        self.org_lrs = group_lrs(optimizer)
        super().__init__(optimizer, last_batch_iteration)

    def ratio(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            ratio = warmup_fraction(self.warmup_type, iteration, self.warmup_num_steps)
            return self.warmup_min_ratio + ratio * (1. - self.warmup_min_ratio)
        real_last_step = iteration - self.warmup_num_steps + 1
        real_total_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        cosine_progress = min(1.0, real_last_step / real_total_steps)
        ratio = (1 + math.cos(math.pi * cosine_progress)) / 2
        return max(0.0, self.cos_min_ratio + (1. - self.cos_min_ratio) * ratio)

    def lrs(self, iteration: int) -> list[float]:
        if iteration < 0:
            return [0.0 for _ in self.org_lrs]
        ratio = self.ratio(iteration)
        return [org_lr * ratio for org_lr in self.org_lrs]


class OneCycle(DeepSpeedSchedule):
    """1Cycle: lr from cycle_min_lr up to cycle_max_lr over cycle_first_step_size iterations and
    back down over cycle_second_step_size (default: the first), optionally in stairs, then
    cycle_min_lr / (1 + decay_lr_rate * d / decay_step_size) at d iterations past the cycle
    (no decay while decay_step_size or decay_lr_rate is 0). With cycle_momentum (default True)
    the betas move the other way, between cycle_max_mom and cycle_min_mom, and beta2 becomes
    0.99 whatever the optimizer had; after construction they are (cycle_min_mom, 0.99) although
    the cycle itself starts at cycle_max_mom. An optimizer without betas (SGD) keeps its
    momentum: DeepSpeed warns and turns cycle_momentum off (build_scheduler refuses an explicit
    true). DeepSpeed: runtime/lr_schedules.py OneCycle."""

    def __init__(self, optimizer: torch.optim.Optimizer, cycle_min_lr: PerGroup, cycle_max_lr: PerGroup,
                 decay_lr_rate: float = 0., cycle_first_step_size: float = 2000,
                 cycle_second_step_size: Optional[float] = None, cycle_first_stair_count: int = 0,
                 cycle_second_stair_count: Optional[int] = None, decay_step_size: float = 0,
                 cycle_momentum: bool = True, cycle_min_mom: PerGroup = 0.8, cycle_max_mom: PerGroup = 0.9,
                 decay_mom_rate: float = 0., last_batch_iteration: int = -1) -> None:
        self.first_step_size = float(number("cycle_first_step_size", cycle_first_step_size))
        self.second_step_size = self.first_step_size if cycle_second_step_size is None else \
            float(number("cycle_second_step_size", cycle_second_step_size))
        if self.first_step_size <= 0 or self.second_step_size < 0:
            raise ValueError(f"DeepSpeed scheduler OneCycle: cycle_first_step_size = {cycle_first_step_size!r} must "
                             f"be positive and cycle_second_step_size = {cycle_second_step_size!r} not negative")
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = cycle_first_stair_count if cycle_second_stair_count is None \
            else cycle_second_stair_count
        self.decay_step_size = number("decay_step_size", decay_step_size)
        self.min_lrs = per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = number("decay_lr_rate", decay_lr_rate)
        self.skip_lr_decay = math.isclose(self.decay_step_size, 0) or math.isclose(self.decay_lr_rate, 0)
        self.cycle_momentum = cycle_momentum and "betas" in optimizer.defaults
        if cycle_momentum and not self.cycle_momentum:
            LOG.info("OneCycle: %s has no betas; momentum is not cycled (as in DeepSpeed)", type(optimizer).__name__)
        self.min_moms = [(mom, 0.99) for mom in per_group(optimizer, cycle_min_mom, "cycle_min_mom")]
        self.max_moms = [(mom, 0.99) for mom in per_group(optimizer, cycle_max_mom, "cycle_max_mom")]
        self.decay_mom_rate = number("decay_mom_rate", decay_mom_rate)
        self.skip_mom_decay = math.isclose(self.decay_step_size, 0) or math.isclose(self.decay_mom_rate, 0)
        super().__init__(optimizer, last_batch_iteration)

    def scale_factor(self, iteration: int) -> float:
        """Where in the cycle: 0 at its ends, 1 at its peak. DeepSpeed: OneCycle._get_scale_factor."""
        batch_iteration = iteration + 1
        cycle = math.floor(1 + batch_iteration / self.total_size)
        x = 1. + batch_iteration / self.total_size - cycle
        if x <= self.step_ratio:
            scale_factor, stair_count = x / self.step_ratio, self.first_stair_count
        else:
            scale_factor, stair_count = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stair_count > 0:  # stairs count from the integer offset, as DeepSpeed does
            cycle_iteration = batch_iteration % self.total_size
            if cycle_iteration <= self.first_step_size:
                stair_position = cycle_iteration * stair_count / self.first_step_size
            else:
                stair_position = (self.total_size - cycle_iteration) * stair_count / self.second_step_size
            scale_factor = math.floor(stair_position) / stair_count
        return scale_factor

    def lrs(self, iteration: int) -> list[float]:
        if iteration < self.total_size:
            scale = self.scale_factor(iteration)
            return [low + (high - low) * scale for low, high in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * ((iteration - self.total_size + 1) / self.decay_step_size)
        return [low / factor for low in self.min_lrs]

    def betas(self, iteration: int) -> list[tuple[float, float]]:
        if iteration < 0:
            return list(self.min_moms)
        if iteration < self.total_size:
            scale = self.scale_factor(iteration)
            return [(high[0] - (high[0] - low[0]) * scale, low[1]) for low, high in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * ((iteration - self.total_size + 1) / self.decay_step_size)
        return [(beta1 * factor, beta2) for beta1, beta2 in self.max_moms]

    def step(self, last_batch_iteration: Optional[int] = None) -> None:
        super().step(last_batch_iteration)
        if self.cycle_momentum:
            for group, betas in zip(self.optimizer.param_groups, self.betas(self.last_batch_iteration)):
                group["betas"] = betas


class LRRangeTest(DeepSpeedSchedule):
    """The LR range test: lr_range_test_min_lr * (1 + lr_range_test_step_rate * n), n the
    iterations done over lr_range_test_step_size, floored with lr_range_test_staircase; it
    starts at the min lr after construction and moves on the first step.
    DeepSpeed: runtime/lr_schedules.py LRRangeTest."""

    def __init__(self, optimizer: torch.optim.Optimizer, lr_range_test_min_lr: PerGroup = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1) -> None:
        self.min_lr = per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = positive_int("lr_range_test_step_size", lr_range_test_step_size)
        self.step_rate = number("lr_range_test_step_rate", lr_range_test_step_rate)
        self.staircase = bool(lr_range_test_staircase)
        super().__init__(optimizer, last_batch_iteration)

    def lrs(self, iteration: int) -> list[float]:
        if self.staircase:
            interval = math.floor(float(iteration + 1) / self.step_size)
        else:
            interval = float(iteration + 1) / self.step_size
        return [min_lr * (1 + self.step_rate * interval) for min_lr in self.min_lr]


SCHEDULERS: dict[str, type[DeepSpeedSchedule]] = {
    "WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR,
    "OneCycle": OneCycle, "LRRangeTest": LRRangeTest}


def build_scheduler(section: Mapping[str, object], optimizer: torch.optim.Optimizer) -> DeepSpeedSchedule:
    """The scheduler DeepSpeed builds from the JSON "scheduler" `section` on `optimizer`: the
    class named by "type" (case as written), called with "params" as keyword arguments.
    DeepSpeed: runtime/engine.py DeepSpeedEngine._scheduler_from_config."""
    name, params = read_section(section, "scheduler", params_required=True)
    cls = SCHEDULERS.get(name)
    fallback = getattr(torch.optim.lr_scheduler, name, None)
    if cls is None and isinstance(fallback, type) and issubclass(fallback, torch.optim.lr_scheduler.LRScheduler) \
            and not any(known.lower() == name.lower() for known in SCHEDULERS):
        # DeepSpeed: a type it does not own is torch.optim.lr_scheduler.<type>(optimizer, **params)
        names = inspect.signature(fallback.__init__).parameters
        check_params(f"DeepSpeed scheduler {name!r} (torch.optim.lr_scheduler.{name})", params,
                     [n for n in names if n not in ("self", "optimizer")])
        return fallback(optimizer, **params)
    if cls is None:
        raise ValueError(f"DeepSpeed scheduler {name!r}: fz3 builds {', '.join(SCHEDULERS)} ({_instead(name)})")
    names = inspect.signature(cls.__init__).parameters
    allowed = [n for n in names if n not in ("self", "optimizer")]
    required = [n for n in allowed if names[n].default is inspect.Parameter.empty]
    check_params(f"DeepSpeed scheduler {name!r}", params, allowed, required)
    if params.get("cycle_momentum") is True and "betas" not in optimizer.defaults:
        raise ValueError(f"DeepSpeed scheduler {name!r}: 'cycle_momentum' = True, but "
                         f"{type(optimizer).__name__} has no betas to cycle (DeepSpeed 0.19.8 warns and "
                         "leaves momentum alone): drop the key or set it false")
    return cls(optimizer, **params)


def _instead(name: str) -> str:
    for known in SCHEDULERS:
        if known.lower() == name.lower():
            return f"DeepSpeed matches the name case-sensitively: write {known!r}"
    if hasattr(torch.optim.lr_scheduler, name):
        return (f"DeepSpeed would fall back to torch.optim.lr_scheduler.{name}; fz3 does not: "
                "pass lr_scheduler= instead")
    return "DeepSpeed does not know it either"
