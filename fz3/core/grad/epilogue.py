"""The gradient lifecycle, part 2: the end of a backward, and the end of an accumulation window.

                      +-- epilogue (each backward's end): grads added into the partitions --+
                      |                                                                     |
                      v                                                                     |
    window open  ---micro_step_end (step() off the boundary: micro_step + 1)----> window open
         |
         | micro_step_end (the boundary's step(): ZeroPartitions, AverageGrads) -> averaged
         v
    averaged  --optimizer_step(applied=True|False)--> window open (the next window; partitions freed)

    epilogue (every backward):  flush every open bucket -> WaitReduce (overlap_comm)
                                -> backward += 1 (clears every "reported" flag at once)
    micro_step_end (every step() the user calls): off the boundary, micro_step += 1; at it,
                                ZeroPartitions(params never written in the window)
                                -> AverageGrads(world_size * gradient_accumulation_steps
                                                / predivide)

Partitions hold SUMs over ranks and backwards (of grads each divided by `predivide` before its
reduce: 1 unless prescale_gradients or gradient_predivide_factor say otherwise) until the
boundary, where one division turns them into the mean gradient, exposed to the optimizer in
place. DeepSpeed instead pre-divides by the world size before each reduce and scales the loss
by 1/gas; summing first keeps the integer test data exact and never relies on a backend's AVG
(fz3/core/grad/grads.py, [Note: pre-division]).

[Note: the window closes at step()] DeepSpeed counts micro-steps by `engine.step()` calls, not
by backwards: a step() is the accumulation boundary when (micro_steps + 1) % gas == 0, or when
set_gradient_accumulation_boundary says so, or every time with managed_gradient_accumulation
false (runtime/engine.py is_gradient_accumulation_boundary, step). So the window is what lies
between two boundary steps, and every backward in it adds: two backwards before one step()
(a GAN's discriminator on real and on fake images) sum, as in plain PyTorch, DDP and FSDP2,
and the boundary divides by W x gas whatever the number of backwards, as DeepSpeed's 1/gas
loss scaling does. `micro_step` is DeepSpeed's position in the window (step() calls mod gas),
kept here so that the boundary is the core's decision (`is_boundary`).

[Note: zero_grad in a window] Plain PyTorch's zero_grad() drops the grads accumulated so far;
DeepSpeed's stage 3 has already reduced them into its partitions and keeps them. The grads of
the backwards since the last step() are dropped (`zero_grads`) when the window holds nothing
older: that is plain PyTorch's answer for every loop that zeroes before its backwards (a GAN's
netD.zero_grad() drops the grads the generator's backward left in the discriminator), and it
changes nothing in DeepSpeed's loops, which zero right after step(). Backwards since a step()
off the boundary were summed into the same partitions as the earlier micro-steps' grads: no
arithmetic separates them, so that call is refused (GradError), naming both ways out.

[Note: no grad, no step] A trainable param that no grad reached in a whole window, on any rank,
has no optimizer grad (None), so every torch optimizer leaves it alone, as in plain PyTorch and
FSDP2: zeros in its place would still move it by AdamW's weight decay and moments (7e-4 from
plain PyTorch after a few steps). For a hooked param "no grad on this rank" is "no grad on any":
a grad on one rank only is a reduce the others do not issue, a divergence (the same for a
param reported at the end of backward instead: fz3/core/calls.py, [Note: persistent grads at
the end of backward]). A leaf's own params
are reduced as zeros where this rank's experts saw no token (fz3/core/calls.py, [Note: leaf
modules]), so whether one got a grad anywhere is each rank's `got` flag summed over ranks
(`leaf_grads`, one small all-reduce at the boundary, only for models with leaf modules).

[Note: a step skipped] At the boundary the global grad norm is known on every rank, the same
bits everywhere (summed in rank order). Not finite (one rank's NaN or inf loss reaches every
partition through the reduce): the window closes without an optimizer step, `skipped` counts
it, and the weights, their shards and every gathered full param stay as they are. DeepSpeed
skips the same way on fp16 overflow (`_overflow_check_and_loss_scale_update`), and its
scheduler does not step either.
"""
from __future__ import annotations

from typing import Optional, Sequence

from fz3.config.config import Config
from fz3.core.effects import AverageGrads, ClearGrads, FreePartitions, GradEffect, WaitReduce, ZeroPartitions
from fz3.core.grad.grads import NEVER, GradError, GradState, flush, flush_waiting, grad_predivide, waiting
from fz3.core.stage import policy
from fz3.core.ids import ParamId


def epilogue(state: GradState, *, config: Config) -> tuple[GradState, tuple[GradEffect, ...]]:
    """End one backward: flush what is left, wait for the reduce stream, reset per-backward flags.

    The window stays open: a later backward adds to the same partitions ([Note: the window
    closes at step()]). Raises GradError if the boundary's step() has averaged the partitions
    and the optimizer step has not consumed them yet.
    DeepSpeed: `independent_gradient_partition_epilogue` (flush, synchronize, clear
    `params_already_reduced`, build `averaged_gradients` views).
    """
    _check_open(state, "epilogue")
    state, flushed = flush(state, config=config)
    effects: list[GradEffect] = list(flushed)
    if config.overlap_comm:
        effects.append(WaitReduce())
    return state._replace(backward=state.backward + 1, micro_backwards=state.micro_backwards + 1), tuple(effects)


def is_boundary(state: GradState, *, config: Config, override: Optional[bool] = None) -> bool:
    """Whether the next step() closes the accumulation window: always without managed
    gradient accumulation; else `override` (set_gradient_accumulation_boundary) if given, else
    when it is the gas-th step() call of the cycle. DeepSpeed: is_gradient_accumulation_boundary
    ((micro_steps + 1) % gas == 0)."""
    if not config.managed_gradient_accumulation:
        return True
    if override is not None:
        return override
    return (state.micro_step + 1) % config.gradient_accumulation_steps == 0


def micro_step_end(state: GradState, *, config: Config, override: Optional[bool] = None,
                   loss_scale: float = 1.0) -> tuple[GradState, tuple[GradEffect, ...]]:
    """The user's step() ([Note: the window closes at step()]). Off the boundary (`is_boundary`)
    the micro-step's grads join the window. At it, the partitions no grad reached in the
    window are zeroed and every partition is divided once into the mean gradient: the window
    is `averaged`, and the optimizer step (or its skip) comes next. `loss_scale`: in fp16, the
    scale divided out here too (fz3/core/grad/scaler.py unscale_by).
    DeepSpeed: engine.step (micro_steps += 1; at the boundary _take_model_step)."""
    _check_open(state, "step()")
    if state.buckets:
        raise GradError("step() with open IPG buckets: a backward is still running; call step() after it")
    gas = config.gradient_accumulation_steps
    moved = state._replace(micro_step=(state.micro_step + 1) % gas)
    if not is_boundary(state, config=config, override=override):
        return moved._replace(micro_backwards=0,
                              committed=state.committed or state.micro_backwards > 0), ()
    effects: list[GradEffect] = []
    if policy(config).grads_at_boundary:  # the window's one reduce ([Note: grads at the boundary])
        state, flushed = flush_waiting(state, config=config)
        effects += flushed
        if config.overlap_comm and flushed:
            effects.append(WaitReduce())
    unwritten = never_written(state)
    if unwritten:
        effects.append(ZeroPartitions(unwritten))
    w = state.spec.ranks  # every rank's grads are in the mean (stage 0: replicas of one layout)
    scaled = loss_scale if config.compute_dtype == "fp16" else None
    effects.append(AverageGrads(grad_divisor(w, gas, grad_predivide(w, config), loss_scale=scaled)))
    return moved._replace(averaged=True, micro_backwards=0), tuple(effects)


def zero_grads(state: GradState, *, config: Config) -> tuple[GradState, tuple[GradEffect, ...]]:
    """zero_grad() ([Note: zero_grad in a window]): the grads of the backwards since the last
    step() are dropped when the window holds nothing older; with nothing to drop, nothing
    changes. Each param's next write in the window is then a copy, and the partitions' memory
    goes back now (FreePartitions), as after an optimizer step. O(params) when it drops.
    Raises GradError when a step() off the boundary already summed older grads into them."""
    if state.micro_backwards == 0 or state.averaged:
        return state, ()
    if state.buckets:
        raise GradError("zero_grad() while a backward is running (an IPG bucket is open)")
    if state.committed:
        raise GradError(
            f"zero_grad() after {state.micro_backwards} backward(s) since a step() inside an accumulation "
            f"window (micro-step {state.micro_step} of {config.gradient_accumulation_steps}): fz3 has summed their "
            "grads into the same partitions as the window's earlier micro-steps and cannot drop them alone. "
            "Call zero_grad() before the backwards of a micro-step or right after step() (plain PyTorch's "
            "order), or not at all inside the window (DeepSpeed's: its step() at the boundary starts the next)")
    w = state.window
    held = waiting(state)
    changes = {p: pg._replace(written=NEVER if pg.written == w else pg.written, got=NEVER if pg.got == w else pg.got,
                              waits=NEVER, wait_dtype="" if pg.waits == w else pg.wait_dtype)
               for p, pg in enumerate(state.params.current()) if w in (pg.written, pg.got, pg.waits)}
    effects: tuple[GradEffect, ...] = (ClearGrads(held),) if held else ()
    return state._replace(params=state.params.set_many(changes), micro_backwards=0), effects + (FreePartitions(),)


def optimizer_step(state: GradState, *, config: Config, applied: bool = True
                   ) -> tuple[GradState, tuple[GradEffect, ...]]:
    """The optimizer consumed the averaged partitions (`applied`), or the step was skipped
    ([Note: a step skipped]): start the next accumulation window.

    The next write of every partition is a copy, so their memory goes back now
    (FreePartitions) and comes again with that write. Raises GradError unless the boundary's
    step() averaged the partitions (they would still hold sums, not means).
    DeepSpeed: the zero_grad of the optimizer after `_take_model_step`.
    """
    if not state.averaged:
        raise GradError(f"optimizer_step before the boundary's step() averaged the grad partitions (micro-step "
                        f"{state.micro_step} of {config.gradient_accumulation_steps}): they hold sums, not means")
    if state.buckets:
        raise GradError("optimizer_step with open IPG buckets: run the epilogue first")
    return state._replace(window=state.window + 1, skipped=state.skipped + (not applied), applied=applied,
                          averaged=False, committed=False, micro_backwards=0), (FreePartitions(),)


def grad_divisor(world_size: int, gradient_accumulation_steps: int, predivide: float = 1.0, *,
                 loss_scale: Optional[float] = None) -> float:
    """Sum -> mean over ranks and micro-steps: W x gas (each micro-step's loss is one term),
    over `predivide`, what each grad was already divided by before its reduce (an int when 1).
    `loss_scale` (fp16): each loss was divided by gas and multiplied by it before its backward
    (DeepSpeed's engine.backward), so the sums are over W x loss_scale / predivide: the grads
    come out unscaled ([Note: unscaled by the grown scale], fz3/core/grad/scaler.py)."""
    if loss_scale is not None:
        return world_size * loss_scale / predivide
    divisor = world_size * gradient_accumulation_steps
    return divisor if predivide == 1 else divisor / predivide


def never_written(state: GradState) -> tuple[ParamId, ...]:
    """Params whose partition got no write in the current window (frozen or unused params).

    O(params): run once per optimizer step, the same order as the optimizer's own work.
    """
    return tuple(ParamId(i) for i, pg in enumerate(state.params) if pg.written != state.window)


def without_grad(state: GradState, trainable: Sequence[bool], got_anywhere: frozenset[ParamId] = frozenset()
                 ) -> tuple[ParamId, ...]:
    """Trainable params no grad reached in the current window: this rank got none (`got`), and
    none is in `got_anywhere`, the leaf params some rank got a real grad for ([Note: no grad, no
    step]). O(params), once per optimizer step, as `never_written`."""
    w = state.window
    return tuple(ParamId(i) for i, pg in enumerate(state.params)
                 if trainable[i] and pg.got != w and i not in got_anywhere)


def at_boundary(state: GradState, *, config: Config) -> bool:
    """True when the partitions hold the averaged grads and the optimizer may step: the
    boundary's step() ran `micro_step_end`, and `optimizer_step` has not yet."""
    return state.averaged


def _check_open(state: GradState, what: str) -> None:
    if state.averaged:
        raise GradError(f"{what} after the boundary's step() averaged the grad partitions and before the "
                        "optimizer step consumed them: call optimizer_step first")
