"""The divergence message's account of the ranks' kinds of pass: a rank that runs a pass the
others never run (an evaluation on rank 0 alone) is named for what it does.

    phase (the descriptor's last field, compared)      in words
    0                                                  (not a gather or a reduce: unstamped)
    PHASE | GRAD | TRAINING                            with grad on in model.train()
    PHASE                                              under torch.no_grad() in model.eval()
    PHASE | TRAINING                                   under torch.no_grad() in model.train()
    PHASE | GRAD                                       with grad on in model.eval()
    PHASE | BACKWARD (| ...)                           in a backward

[Note: rank-only evaluation] nanoGPT evaluates on rank 0 alone (`if master_process:
estimate_loss()`, under torch.no_grad() and model.eval()) while the other ranks go on training.
Under ZeRO-3 that cannot run: each forward gathers every module's params from every rank. Its
first forward's gathers are the very gathers of the other ranks' training forward, so a check of
the params alone let that forward pass and failed later, naming a module of the backward
('step 1, collective 17: all-gather ... of module lm_head'), which tells the user nothing of
what they did. The descriptor of every gather and reduce therefore carries the pass it is made
in (grad mode, the model's train/eval mode, forward or backward), read on the rank when the
collective is posted, and compares it: ranks in different kinds of pass diverge at their first
gather, and the message says which rank runs what and what to do instead. Ranks that run the
same modules in different modes (one rank forgot model.eval()) are stopped too: their results
would differ (dropout, batch norm) though their collectives line up.
DeepSpeed: the eval rank and the training ranks wait in mismatched collectives until NCCL's
timeout (30 minutes by default).
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch

PHASE, TRAINING, GRAD, BACKWARD = 1, 2, 4, 8
"""The phase's bits: PHASE (stamped), the model's train mode, grad mode, inside a backward."""


def phase_reader(training: Callable[[], bool]) -> Callable[[], int]:
    """-> phase(): this rank's pass as the descriptor's phase, read now. `training()`: the
    model's train mode (model.training, as the core's pass kind reads it at the root). Inside
    autograd's backward (torch's graph task is set) the phase is BACKWARD whatever grad mode the
    engine runs it in."""
    is_grad_enabled, graph_task = torch.is_grad_enabled, torch._C._current_graph_task_id

    def phase() -> int:
        if graph_task() != -1:
            return PHASE | BACKWARD | (TRAINING if training() else 0)
        return PHASE | (GRAD if is_grad_enabled() else 0) | (TRAINING if training() else 0)
    return phase


def words(phase: int) -> str:
    """The phase as the user wrote it: 'under torch.no_grad() in model.eval()', ... ('' if unstamped)."""
    if not phase & PHASE:
        return ""
    if phase & BACKWARD:
        return "in a backward"
    grad = "with grad on" if phase & GRAD else "under torch.no_grad()"
    return f"{grad} in model.{'train' if phase & TRAINING else 'eval'}()"


def pass_hint(where: Mapping[int, Sequence[int]], field: int) -> str:
    """`where`: each rank's descriptor; `field`: the phase's index in it. -> the paragraph that
    says how the ranks' passes differ and what to do ([Note: rank-only evaluation]), or '' when
    every stamped rank is in the same kind of pass."""
    phases = {r: v[field] for r, v in where.items() if v[field] & PHASE}
    if len(set(phases.values())) < 2:
        return ""
    groups: dict[int, list[int]] = {}
    for r in sorted(phases):
        groups.setdefault(phases[r], []).append(r)
    each = "; ".join(f"{_ranks(rs)} {words(ph)}{_label(ph)}" for ph, rs in groups.items())
    return (f"The ranks are in different kinds of pass ({_differ(set(phases.values()))}): {each}. One rank runs "
            "a pass that another never runs, such as an evaluation on rank 0 alone (`if master_process: "
            "estimate_loss()`). Every rank must run every forward under ZeRO-3: each forward gathers every "
            "module's params from all ranks. Run the evaluation on every rank (each on its own batches; "
            "average the losses with torch.distributed.all_reduce), or evaluate an unsharded copy of the model: "
            "sd = engine.full_state_dict() on every rank, then, on rank 0 alone, copy.load_state_dict(sd) and "
            "evaluate the copy.")


def _ranks(rs: Sequence[int]) -> str:
    return f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} {'run' if len(rs) > 1 else 'runs'}"


def _label(phase: int) -> str:
    if phase & BACKWARD:
        return " (training)"
    if not phase & GRAD and not phase & TRAINING:
        return " (an evaluation)"
    return " (training)" if phase & GRAD and phase & TRAINING else ""


def _differ(phases: set[int]) -> str:
    """Which of the modes differ among `phases`: grad mode, train/eval mode, forward/backward."""
    what = []
    forwards = {p for p in phases if not p & BACKWARD}
    if len({p & BACKWARD for p in phases}) > 1:
        what.append("forward or backward")
    if len({p & GRAD for p in forwards}) > 1:
        what.append("grad mode")
    if len({p & TRAINING for p in phases}) > 1:
        what.append("train/eval mode")
    return "they differ in " + " and ".join(what)
