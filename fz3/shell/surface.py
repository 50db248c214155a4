"""The names DeepSpeed scripts call on the engine, with DeepSpeed 0.19.8's answers.

    engine.train() / eval() / parameters() / named_parameters() / zero_grad() / no_sync()
    engine.device, local_rank, global_rank, bfloat16_enabled(), zero_optimization_stage(), ...
    engine.global_steps, global_samples, micro_steps, skipped_steps
    engine.is_gradient_accumulation_boundary()      DeepSpeed's answer, call for call
    engine.gradient_accumulation_steps(), train_micro_batch_size_per_gpu(), train_batch_size()
    (engine.save_16bit_model: fz3/io/engine_methods.py, with the other methods that move values)

[Note: DeepSpeed's counters] DeepSpeed counts `engine.step()` calls, not backwards:
micro_steps += 1 at the end of every step(); at a boundary step global_steps += 1 and
global_samples += train_batch_size() (a skipped step counts too, and skipped_steps says how
many). `is_gradient_accumulation_boundary()` answers whether the NEXT step() will be a boundary:
(micro_steps + 1) % gradient_accumulation_steps == 0. So with 2 accumulation steps, asked before
forward / after backward / after step over two micro-steps, it says (F, F, T), (T, T, F). fz3's
step() closes the window at the same step() calls (the core decides it from its own count of
them, micro_steps mod gas: fz3/core/grad/epilogue.py is_boundary), and every backward before it
adds. With managed_gradient_accumulation false every step() is the boundary, and
is_gradient_accumulation_boundary() is True only while step() runs, as DeepSpeed's; each
backward then adds train_batch_size / gas samples. `was_step_applied()` is False after every
step() that did not step the optimizer: between boundaries, and at a skipped one. After
load_checkpoint, global_steps, global_samples and skipped_steps are the saved ones and
micro_steps is this engine's (0 for a fresh engine), as DeepSpeed's load_checkpoint leaves them.
DeepSpeed: runtime/engine.py step, _take_model_step, is_gradient_accumulation_boundary,
_load_checkpoint.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from fz3.shell import log


@dataclass(frozen=True)
class BatchSizes:
    """DeepSpeed's batch sizes beside the config's gradient_accumulation_steps; None where the
    engine was built by fz3.initialize, which is given no batch size."""

    train_batch_size: Optional[int]
    train_micro_batch_size_per_gpu: Optional[int]


class DeepSpeedSurface:
    """Mixed into the Engine: DeepSpeed's method names over the engine's state. Reads
    `self.module`, `self.config`, `self.batch`, `self.micro_steps`, `self.global_samples`,
    `self.grads_state`; the counters are moved by the engine's step()."""

    # ---- the module -----------------------------------------------------------------------------

    def train(self, mode: bool = True) -> None:
        """module.train(mode); -> None, as DeepSpeed's override of nn.Module.train returns.
        DeepSpeed: DeepSpeedEngine.train."""
        self.module.train(mode)

    def eval(self) -> None:
        """module.train(False); -> None. DeepSpeed: DeepSpeedEngine.eval."""
        self.module.train(False)

    @property
    def training(self) -> bool:
        return self.module.training

    def compile(self, backend: str | Callable = "inductor", compile_kwargs: dict | None = None,
                schedule=None, compiled_autograd_enabled: bool = False) -> None:
        """Compile the model's repeated blocks (a transformer's layers; without any, each child
        of the root that holds params) in place with torch.compile(backend=backend,
        **compile_kwargs), each one fetch unit with fz3's hooks outside its graph ([Note:
        compiled regions], fz3/shell/compiled.py). Call it before the first forward. Blocks
        compiled before fz3.initialize need no call. DeepSpeed: DeepSpeedEngine.compile (which
        compiles the whole module, a graph break at every module's hooks)."""
        from fz3.shell.compiled import compile_engine
        self.compiled_regions = compile_engine(self, backend, compile_kwargs, schedule, compiled_autograd_enabled)
        log.compiled(self, backend, self.compiled_regions)

    @property
    def is_compiled(self) -> bool:
        """engine.compile() ran, or some fetch unit is a module compiled before initialize.
        DeepSpeed: DeepSpeedEngine.is_compiled."""
        return bool(self.tables.compiled)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """The model's params (the sharded placeholders) named as DeepSpeed's engine names them:
        it is an nn.Module holding the model as `module`, so every name starts with "module.".
        DeepSpeed: DeepSpeedEngine.named_parameters (nn.Module's)."""
        inner = prefix + ("." if prefix else "") + "module"
        return self.module.named_parameters(prefix=inner, recurse=recurse, remove_duplicate=remove_duplicate)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self.module.parameters(recurse=recurse)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Every model param's .grad = None, and the grads of the backwards since the last
        step() dropped from fz3's partitions, as plain PyTorch's zero_grad drops them ([Note:
        zero_grad in a window], fz3/core/grad/epilogue.py: right after step() there are none).
        DeepSpeed: DeepSpeedEngine.zero_grad."""
        self.grads_zeroed()
        for p in self.module.parameters():
            p.grad = None

    @contextlib.contextmanager
    def coalesce_grad_reduction(self):
        """DeepSpeed 0.19.8's block of several backwards for one optimizer step: their grads add,
        and step() inside the block raises (AssertionError, with DeepSpeed's message), as does
        nesting it. fz3's ZeRO-3 keeps no whole grads, so it reduces each backward's into the
        partitions as they come, inside the block too: the same sum DeepSpeed's one reduction at
        the block's exit makes ([Note: the window closes at step()], fz3/core/grad/epilogue.py).
        DeepSpeed: DeepSpeedEngine.coalesce_grad_reduction."""
        if not self.config.managed_gradient_accumulation:
            raise AssertionError("coalesce_grad_reduction is not supported with managed_gradient_accumulation=False; "
                                 "the caller already owns the accumulation boundary via step()")
        if self.inside_no_sync:
            raise AssertionError("coalesce_grad_reduction cannot be nested inside another no_sync context")
        self.inside_no_sync = True
        try:
            yield
        finally:
            self.inside_no_sync = False

    @contextlib.contextmanager
    def no_sync(self):
        """Stages 0 and 1: the backwards inside add their grads in param.grad, where every grad
        waits for the boundary's reduce anyway ([Note: grads at the boundary],
        fz3/core/grad/grads.py); step() inside raises, as does nesting. Stages 2 and 3 reduce
        grads into partitions in every backward, so there is no reduce to skip: an
        AssertionError, with DeepSpeed's message. DeepSpeed: no_sync."""
        if self.config.stage >= 2:
            raise AssertionError("no_sync context manager is incompatible with gradient partitioning logic of "
                                 f"ZeRO stage {self.config.stage}")
        if self.inside_no_sync:
            raise AssertionError("no_sync context manager reentry is unsupported")
        self.inside_no_sync = True
        try:
            yield
        finally:
            self.inside_no_sync = False

    # ---- where and what it runs ------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """This rank's torch device (`batch.to(engine.device)`). DeepSpeed: DeepSpeedEngine.device."""
        return self.accelerator.torch_device

    @property
    def local_rank(self) -> int:
        """LOCAL_RANK as torchrun sets it (0 without it). DeepSpeed: DeepSpeedEngine.local_rank."""
        return int(os.environ.get("LOCAL_RANK", 0))

    @property
    def global_rank(self) -> int:
        return self.rank

    def bfloat16_enabled(self) -> bool:
        return self.config.compute_dtype == "bf16"

    def fp16_enabled(self) -> bool:
        return self.config.compute_dtype == "fp16"

    def zero_optimization(self) -> bool:
        return self.config.stage > 0

    def zero_optimization_stage(self) -> int:
        return self.config.stage

    def zero_optimization_partition_gradients(self) -> bool:
        return self.config.stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.config.stage == 3

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    # ---- counters ([Note: DeepSpeed's counters]) -------------------------------------------------

    @property
    def global_steps(self) -> int:
        """Accumulation boundaries stepped through, skipped steps included."""
        return self.optimizer_steps

    @property
    def skipped_steps(self) -> int:
        return self.skipped

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next step() closes an accumulation window ([Note: DeepSpeed's counters]),
        or what set_gradient_accumulation_boundary last set; without managed gradient
        accumulation, whether step() is running. DeepSpeed: is_gradient_accumulation_boundary."""
        if not self.config.managed_gradient_accumulation:
            return self.in_step
        if self.boundary_override is not None:
            return self.boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Override is_gradient_accumulation_boundary()'s answer, and so whether the next step()
        closes the window (None: DeepSpeed's counter again). DeepSpeed:
        set_gradient_accumulation_boundary."""
        if not self.config.managed_gradient_accumulation:
            raise AssertionError("set_gradient_accumulation_boundary() is not supported with "
                                 "managed_gradient_accumulation=False; the caller owns the boundary by calling step()")
        if is_boundary is not None and not isinstance(is_boundary, bool):
            raise TypeError(f"set_gradient_accumulation_boundary expects a bool, got {is_boundary!r}")
        self.boundary_override = is_boundary

    def _count_step(self, boundary: bool) -> None:
        """What DeepSpeed's step() counts ([Note: DeepSpeed's counters])."""
        if boundary and self.batch.train_batch_size is not None:
            if self.config.managed_gradient_accumulation:
                self.global_samples += self.batch.train_batch_size
            else:  # the micro-batches actually run since the last step()
                self.global_samples += self.batch.train_batch_size // self.gradient_accumulation_steps() \
                    * self.unmanaged_backwards
        self.unmanaged_backwards = 0
        self.micro_steps += 1

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._batch_size("train_micro_batch_size_per_gpu")

    def train_batch_size(self) -> int:
        return self._batch_size("train_batch_size")

    def _batch_size(self, name: str) -> int:
        value = getattr(self.batch, name)
        if value is None:
            raise ValueError(f"engine.{name}(): this engine was built by fz3.initialize, which is given no "
                             "batch size; build it with fz3.deepspeed.initialize and a config that sets "
                             "train_batch_size or train_micro_batch_size_per_gpu")
        return value
