"""The gradient lifecycle, part 2: the end of a backward and the end of an accumulation window.

    micro_step:   0 --epilogue--> 1 --epilogue--> ... --epilogue--> gas   (window complete:
                  ^                                                  |     partitions averaged)
                  +---------- optimizer_step(applied=True|False) ----+   (partitions freed)

    epilogue (every backward):  flush every open bucket -> WaitReduce (overlap_comm)
                                -> backward += 1 (clears every "reported" flag at once)
                                -> micro_step += 1
    ... and at the boundary (micro_step reaches gradient_accumulation_steps):
                                ZeroPartitions(params never written in the window)
                                -> AverageGrads(world_size * gradient_accumulation_steps
                                                / predivide)

Partitions hold SUMs over ranks and micro-steps (of grads each divided by `predivide` before its
reduce: 1 unless prescale_gradients or gradient_predivide_factor say otherwise) until the
boundary, where one division turns them into the mean gradient, exposed to the optimizer in
place. DeepSpeed instead pre-divides by the world size before each reduce and scales the loss
by 1/gas; summing first keeps the integer test data exact and never relies on a backend's AVG
(fz3/core/grad/grads.py, [Note: pre-division]).

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

from typing import Sequence

from fz3.config.config import Config
from fz3.core.effects import AverageGrads, FreePartitions, GradEffect, WaitReduce, ZeroPartitions
from fz3.core.grad.grads import GradError, GradState, flush, grad_predivide
from fz3.core.ids import ParamId


def epilogue(state: GradState, *, config: Config) -> tuple[GradState, tuple[GradEffect, ...]]:
    """End one backward: flush what is left, wait for the reduce stream, reset per-backward flags.

    At the accumulation boundary also zero the partitions no grad reached in this window and
    average them all once. Raises GradError if the window was already complete.
    DeepSpeed: `independent_gradient_partition_epilogue` (flush, synchronize, clear
    `params_already_reduced`, build `averaged_gradients` views); DeepSpeed advances
    micro_step_id at the next forward, fz3 here.
    """
    gas = config.gradient_accumulation_steps
    if state.micro_step >= gas:
        raise GradError(f"epilogue: the accumulation window is complete ({state.micro_step} "
                        f"micro-steps of {gas}); call optimizer_step first")
    state, flushed = flush(state, config=config)
    effects: list[GradEffect] = list(flushed)
    if config.overlap_comm:
        effects.append(WaitReduce())
    state = state._replace(backward=state.backward + 1, micro_step=state.micro_step + 1)
    if state.micro_step == gas:
        unwritten = never_written(state)
        if unwritten:
            effects.append(ZeroPartitions(unwritten))
        w = state.spec.world_size
        effects.append(AverageGrads(grad_divisor(w, gas, grad_predivide(w, config))))
    return state, tuple(effects)


def optimizer_step(state: GradState, *, config: Config, applied: bool = True
                   ) -> tuple[GradState, tuple[GradEffect, ...]]:
    """The optimizer consumed the averaged partitions (`applied`), or the step was skipped
    ([Note: a step skipped]): start the next accumulation window.

    Resets micro_step to 0; the next write of every partition is a copy, so their memory goes
    back now (FreePartitions) and comes again with that write. Raises GradError if
    the window is not complete (partitions would still hold sums, not means).
    DeepSpeed: the micro_step_id reset in `step` / `zero_grad`.
    """
    if state.micro_step != config.gradient_accumulation_steps:
        raise GradError(f"optimizer_step after {state.micro_step} of "
                        f"{config.gradient_accumulation_steps} micro-steps: the grad partitions "
                        "are averaged only at the accumulation boundary")
    if state.buckets:
        raise GradError("optimizer_step with open IPG buckets: run the epilogue first")
    return state._replace(micro_step=0, window=state.window + 1, skipped=state.skipped + (not applied),
                          applied=applied), (FreePartitions(),)


def grad_divisor(world_size: int, gradient_accumulation_steps: int, predivide: float = 1.0
                 ) -> float:
    """Sum -> mean over ranks and micro-steps: W x gas (each micro-step's loss is one term),
    over `predivide`, what each grad was already divided by before its reduce (an int when 1)."""
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
    """True when the partitions hold the averaged grads and the optimizer may step."""
    return state.micro_step == config.gradient_accumulation_steps
