"""The verdict on the device, as the shell runs it ([Note: the verdict on the device],
fz3/core/grad/verdict.py): the flag a fused optimizer takes, its copy read later, the lr
scheduler put back, the WARNING of a step skipped named a step late.

    on_device(optimizer, config, host_step)  None where the verdict may stay on the device, else
                              why it is read at the boundary (what the engine names once)
    DeviceVerdict.guard       around the optimizer's step(): `optimizer.found_inf` is the flag
                              (1.0 where the norm is not finite); each param's grad tested (its
                              max |g| finite) for the WARNING; the flag's copy to the host started
    DeviceVerdict.read        the copy, once it has landed (an event's wait: the work queued
                              after the step goes on)
    step_scheduler/put_back   the lr scheduler stepped so that it can go back: its state_dict and
                              the optimizer's group settings kept
"""
from __future__ import annotations

import contextlib
import copy

import torch

from fz3.config.config import Config


def on_device(optimizer: torch.optim.Optimizer, config: Config, *, host_step: bool) -> str | None:
    """None when the skip of a non-finite step can be decided on the device: a torch optimizer
    that takes `found_inf` (fused=True Adam, AdamW, SGD or Adagrad: what torch's GradScaler
    checks, `_step_supports_amp_scaling`). Else why the host reads the verdict at the boundary."""
    if host_step:
        return "the optimizer steps on the host (offload_optimizer)"
    if not getattr(optimizer, "_step_supports_amp_scaling", False) or \
            not all(g.get("fused") for g in optimizer.param_groups):
        return (f"{type(optimizer).__module__}.{type(optimizer).__name__} cannot take the verdict as a tensor "
                "(torch's fused optimizers can: torch.optim.AdamW(..., fused=True), and Adam, SGD, Adagrad)")
    return None


class DeviceVerdict:
    """The pending step's flag, its copy on the host and what naming its skip needs."""

    def __init__(self, device) -> None:
        self.device = device  # the shell's Device (fz3/shell/device.py)
        self.host: torch.Tensor | None = None  # the flag's copy: pinned host memory on an accelerator
        self.event = None  # recorded after the copy was queued
        self.norm: torch.Tensor | None = None  # the pending step's norm, as reported
        self.params = 0  # the params of the pending step's partitions
        self.tested: list[tuple[int, torch.Tensor]] = []  # (ParamId, max |grad| of its partition)

    @contextlib.contextmanager
    def guard(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor, scale, reported: torch.Tensor,
              partitions: list) -> None:
        """optimizer.step() inside it skips on the device where `found_inf` (the norm not finite)
        is 1. `scale`: fp16's (old, new, at_min) DeviceScales of this step (None outside fp16),
        copied beside the flag so that the read a step late logs the move and raises at the
        minimum."""
        present = [(p, t) for p, t in enumerate(partitions) if t is not None]
        maxes = torch._foreach_norm([t for _, t in present], float("inf")) if present else []
        self.tested, self.norm = [(p, m) for (p, _), m in zip(present, maxes)], reported
        self.params = len(partitions)
        optimizer.found_inf, optimizer.grad_scale = found_inf, None
        try:
            yield
        finally:
            del optimizer.found_inf, optimizer.grad_scale
        flags = found_inf.reshape(1) if scale is None else torch.stack(
            [found_inf.double(), scale[2].double(), scale[0].scale.double(), scale[0].hysteresis.double(),
             scale[1].scale.double(), scale[1].hysteresis.double()])
        if self.device.type == "cpu":
            self.host, self.event = flags, None
        else:
            if self.host is None or self.host.shape != flags.shape or self.host.dtype != flags.dtype:
                self.host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            self.host.copy_(flags, non_blocking=True)
            self.event = self.device.record_event()

    def read(self) -> bool:
        """Whether the pending step applied (its norm finite). On an accelerator it waits for the
        copy's event alone, queued right after that step's norm: by the next boundary it has
        long landed, and the work queued since goes on."""
        if self.event is not None:
            self.event.synchronize()
        return not bool(self.host[0])

    def scale_read(self) -> tuple[bool, tuple[float, int], tuple[float, int]]:
        """After `read`, fp16's: (at its minimum and overflowed again, (old scale, hysteresis),
        (new scale, hysteresis))."""
        at_min, s0, h0, s1, h1 = self.host[1:].tolist()
        return bool(at_min), (s0, int(h0)), (s1, int(h1))

    def nonfinite(self) -> tuple[bool, ...]:
        """By ParamId: whether its grad partition held a NaN or an inf at the pending step (one
        read, on the rare path of a skip)."""
        flags = [False] * self.params
        if self.tested:
            for (p, _), bad in zip(self.tested, torch.stack([m for _, m in self.tested]).isfinite()
                                   .logical_not().tolist()):
                flags[p] = bad
        return tuple(flags)


def step_scheduler(lr_scheduler, optimizer: torch.optim.Optimizer, lr_kwargs: dict, *, undoable: bool):
    """lr_scheduler.step(**lr_kwargs); `undoable`: -> what put_back needs (else None)."""
    kept = None
    if undoable:
        state = lr_scheduler.state_dict() if hasattr(lr_scheduler, "load_state_dict") else \
            {k: v for k, v in vars(lr_scheduler).items() if k != "optimizer"}
        groups = [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in g.items() if k != "params"}
                  for g in optimizer.param_groups]
        kept = (copy.deepcopy(state), groups)
    lr_scheduler.step(**lr_kwargs)
    return kept


def put_back(lr_scheduler, optimizer: torch.optim.Optimizer, kept) -> None:
    """The lr scheduler and the optimizer's group settings as they were before the step."""
    state, groups = kept
    if hasattr(lr_scheduler, "load_state_dict"):
        lr_scheduler.load_state_dict(state)
    else:
        vars(lr_scheduler).update(state)
    for g, settings in zip(optimizer.param_groups, groups):
        g.update(settings)
