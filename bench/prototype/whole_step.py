"""PROTOTYPE (issue #25 point 5): one whole training step compiled as one graph, fz3's effect
program put into it as functional collectives, as SimpleFSDP and DeepSpeed's DeepCompile do.

    engine (eager fz3, one step run) --trace COMPLETE--> Program: the all-gathers, in fetch order
    Program + plain template module --make_step--> step(shards, x, y) -> loss
        per Gather: cat(shards) -> all_gather_into_tensor + wait_tensor -> split, unpad, view
        functional_call(template, full params, (x,)) -> cross-entropy
    torch.compile(step, fullgraph=True): AOT autograd derives the backward in the same graph;
    each gather's backward is reduce_scatter_tensor (SUM) / W, so loss.backward() leaves every
    shard its averaged grad partition, and torch AdamW steps on the shards.

A prototype, not an fz3 feature: it runs beside the engine, not inside it (no hooks, no core
transitions at run time); it reads the engine's recorded trace once, and checks nothing after
that (a model whose module order changes needs a new Program: see /tmp/whole_step_notes.md,
later docs/compile.md). How to run it:

    pytest tests/test_whole_step.py                # parity on 2 gloo ranks, tiny GPT, aot_eager
    python bench/diagnostics/whole_step.py                     # eager vs compiled blocks vs this, small GPT

[Note: recompute the gathers] Left to itself, AOT's partitioner saves what the backward needs,
and a Linear's backward needs its full weight: every gathered param stays alive from forward to
backward, so the step holds the unsharded model (ZeRO-3's memory saving is gone). With
`recompute=True` each Gather's region (cat, all-gather, unpad) runs under selective activation
checkpointing with every op MUST_RECOMPUTE: the partitioner saves the shards (graph inputs,
alive anyway) and gathers again in the backward, which is what fz3's eager backward fetch does.
SimpleFSDP: torchtitan `experiments/simple_fsdp/simple_fsdp.py`, `fsdp_policy`.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from fz3.core.ids import TraceMode
from fz3.core.param.state import unit_of
from fz3.core.param.trace import TRAIN, TraceState, reset
from fz3.data.layout import shard_of
from gpt import loss_fn


@dataclass(frozen=True)
class Gather:
    """One all-gather of the step: the params a fetch unit uses first, in id order. The flat
    buffer is rank-major: row r of its (W, sum s) view is rank r's shards, concatenated."""

    unit: str  # the fetch unit (module) whose fetch gathers them first, display only
    params: tuple[int, ...]  # ParamIds
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    shard_numels: tuple[int, ...]


@dataclass(frozen=True)
class Program:
    """The forward's gathers in trace order; the backward's reduce-scatters are their autograd."""

    gathers: tuple[Gather, ...]
    world_size: int


def program_from_trace(engine, *, bucket_numel: int = 0) -> Program:
    """The gathers of one forward, read off `engine`'s training trace (COMPLETE, or recorded by
    one finished step: `_closed_trace`): each param in the step (fetch) where it is first
    gathered, one Gather per step; with `bucket_numel` > 0, consecutive steps merge until a
    Gather holds at least that many elements (a prefetch bucket's grouping)."""
    trace = _closed_trace(engine)
    spec, tables = engine.spec, engine.tables
    steps: dict[int, list[int]] = {}
    seen: set[int] = set()
    for step, p in trace.plan.queue:
        if p not in seen:
            seen.add(p)
            steps.setdefault(step, []).append(p)
    missing = [tables.names[p] for p in range(len(spec.params)) if p not in seen]
    if missing:
        raise ValueError(f"params never fetched in the trace: {missing}")
    groups: list[tuple[str, list[int]]] = []
    for step, pids in steps.items():  # dicts keep insertion order: the trace's
        unit = tables.module_names[trace.plan.order[step]] or "<root>"
        if groups and sum(spec.params[q].numel for q in groups[-1][1]) < bucket_numel:
            groups[-1] = (f"{groups[-1][0]}+{unit}", groups[-1][1] + pids)
        else:
            groups.append((unit, pids))
    return Program(tuple(_gather(unit, pids, engine) for unit, pids in groups), spec.world_size)


def _closed_trace(engine) -> TraceState:
    """The engine's training trace, COMPLETE: as it is, or, after the first step (a RECORD
    trace whose pass ended), closed as the next forward's `reset` will close it (pure: the
    engine is not touched). Call it between steps."""
    st, trace = engine.params_state, engine.params_state.trace
    if trace.mode is TraceMode.RECORD and trace.step_id > 0 and trace.kind == TRAIN:
        trace = reset(trace, lambda m: unit_of(st, m), lambda p: st.spec.params[p].numel,
                      engine.config.max_reuse_distance)
    if trace.mode is not TraceMode.COMPLETE or trace.kind != TRAIN:
        raise ValueError(f"need a COMPLETE {TRAIN!r} trace (run one eager training step first); "
                         f"got {TraceMode(trace.mode).name} {trace.kind!r}")
    return trace


def _gather(unit: str, pids: Sequence[int], engine) -> Gather:
    names, shapes = engine.tables.names, engine.store.shapes  # a freed param keeps its shape there
    return Gather(unit, tuple(pids), tuple(names[p] for p in pids), tuple(tuple(shapes[p]) for p in pids),
                  tuple(engine.spec.params[p].shard_numel for p in pids))


class _GatherShards(torch.autograd.Function):
    """all_gather_into_tensor (flat, rank-major) + wait; backward: reduce_scatter_tensor SUM,
    then / W (fz3 divides itself: gloo's AVG is unreliable, docs/environment.md)."""

    @staticmethod
    def forward(ctx, flat: torch.Tensor, world: int, group: str) -> torch.Tensor:
        ctx.world, ctx.group = world, group
        return fc.all_gather_single(flat, 0, group)  # (W * S,)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return fc.reduce_scatter_single(grad, "sum", 0, ctx.group) / ctx.world, None, None  # (S,)


def gather_full(shards: Sequence[torch.Tensor], g: Gather, world: int, group: str) -> tuple[torch.Tensor, ...]:
    """This rank's shards of `g` -> the full params (their real shapes)."""
    flat = torch.cat(list(shards))  # (S,) S = sum of g's shard numels
    rows = _GatherShards.apply(flat, world, group).view(world, -1)  # (W, S)
    out = []
    for piece, shape in zip(rows.split(list(g.shard_numels), dim=1), g.shapes):  # (W, s)
        numel = 1
        for d in shape:
            numel *= d
        out.append(piece.reshape(-1)[:numel].view(shape))
    return tuple(out)


def _recompute_all(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_RECOMPUTE  # [Note: recompute the gathers]


def make_step(template: nn.Module, program: Program, group: str, *, recompute: bool = False) -> Callable:
    """step(shards, x, y) -> loss: every Gather in order, then `template`'s forward on the full
    params (functional_call, ties as in the template), then the cross-entropy."""
    world = program.world_size
    context = functools.partial(create_selective_checkpoint_contexts, _recompute_all)

    def step(shards: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        params: dict[str, torch.Tensor] = {}
        for g in program.gathers:
            mine = [shards[p] for p in g.params]
            if recompute:
                full = checkpoint(gather_full, mine, g, world, group, use_reentrant=False,
                                  context_fn=context, preserve_rng_state=False)
            else:
                full = gather_full(mine, g, world, group)
            params.update(zip(g.names, full))
        return loss_fn(torch.func.functional_call(template, params, (x,)), y)  # logits (B, T, V)

    return step


class WholeStep:
    """Shards (fp32 leaves, requires_grad), torch AdamW on them, and the compiled step."""

    def __init__(self, template: nn.Module, program: Program, shards: list[torch.Tensor], *,
                 backend="inductor", recompute: bool = False, optimizer=None) -> None:
        names = [n for n, _ in template.named_parameters()]
        order = sorted(p for g in program.gathers for p in g.params)
        flat_names = {p: n for g in program.gathers for p, n in zip(g.params, g.names)}
        if [flat_names[p] for p in order] != names:
            raise ValueError("the template's params are not the traced model's")
        self.shards = [s.detach().clone().requires_grad_(True) for s in shards]
        self.optimizer = (optimizer or adamw)(self.shards)
        group = dist.group.WORLD.group_name
        self.fn = torch.compile(make_step(template, program, group, recompute=recompute),
                                backend=backend, fullgraph=True)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.fn(self.shards, x, y)
        loss.backward()
        self.optimizer.step()
        return loss.item()


def adamw(params) -> torch.optim.Optimizer:
    """The optimizer every compared system steps with: torch AdamW, bench/systems/common.py's."""
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def shards_of(model: nn.Module, rank: int, world: int) -> list[torch.Tensor]:
    """Rank's fp32 shard of each param of an unsharded `model`, in ParamId order."""
    return [shard_of(p.detach().float(), rank, world) for _, p in model.named_parameters()]


# ---- looking at the graphs ------------------------------------------------------------------

COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "wait_tensor")


class CaptureGraphs:
    """A torch.compile backend: AOT autograd with inductor's partitioner (min-cut), run eagerly
    (like aot_eager), keeping the forward and backward graphs it made for `counts` / `saved_bytes`."""

    def __init__(self) -> None:
        self.forward: list[torch.fx.GraphModule] = []
        self.backward: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
        from torch._dynamo.backends.common import aot_autograd

        def keep(graphs: list):
            def compiler(g: torch.fx.GraphModule, _inputs):
                graphs.append(g)
                return make_boxed_func(g.forward)
            return compiler
        return aot_autograd(fw_compiler=keep(self.forward), bw_compiler=keep(self.backward),
                            partition_fn=min_cut_rematerialization_partition)(gm, example_inputs)


def counts(gm: torch.fx.GraphModule) -> dict[str, int]:
    """How many of each functional collective `gm` calls."""
    out = dict.fromkeys(COLLECTIVES, 0)
    for node in gm.graph.nodes:
        name = getattr(node.target, "__name__", "")
        for c in COLLECTIVES:
            if node.op == "call_function" and name.startswith(c):
                out[c] += 1
    return out


def saved_bytes(forward: torch.fx.GraphModule, user_outputs: int = 1) -> dict[str, int]:
    """Bytes of the tensors a forward graph keeps for its backward (its outputs past the user's),
    by kind: "inputs" (the shards themselves: alive anyway), "gathered" (a gathered buffer, or a
    view or copy of one: what ZeRO-3 frees and recompute drops), "activations" (the rest)."""
    (outputs,) = [n.args[0] for n in forward.graph.nodes if n.op == "output"]
    out = {"inputs": 0, "gathered": 0, "activations": 0}
    for n in outputs[user_outputs:]:
        val = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
        if isinstance(val, torch.Tensor):
            out[_kind(n)] += val.numel() * val.element_size()
    return out


def _kind(node: torch.fx.Node) -> str:
    """Walk back through single-input ops (views, copies, slices) to where a saved tensor came from."""
    while node.op == "call_function" and not _named(node, "wait_tensor"):
        inputs = node.all_input_nodes
        if len(inputs) != 1:
            break
        node = inputs[0]
    if node.op == "placeholder":
        return "inputs"
    return "gathered" if _named(node, "wait_tensor") else "activations"


def _named(node: torch.fx.Node, name: str) -> bool:
    return node.op == "call_function" and getattr(node.target, "__name__", "").startswith(name)
