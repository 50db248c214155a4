"""torch.compile through fz3 (issue #25): compiled blocks, engine.compile(), no recompiles.

A tiny GPT's blocks compiled before fz3.initialize (block.compile(), torch.compile(block), or
torch.compile of a model with such blocks) or by engine.compile() train on 2 and 3 ranks at
parity with the same compiled model in one process ([Note: the reference], fz3/testing/
parity.py), under the eager, aot_eager and inductor backends, with gradient accumulation, bf16
compute, activation checkpointing and a DeepSpeed config; after warm-up, more steps (train and
eval alternating, across accumulation boundaries) compile nothing more, and fz3's hooks add no
graph break. Thread ranks (fz3.launch.run_threads: the real engine, one process, so one compile
serves every rank); one case on gloo processes. Inductor's first compile dominates: the model is
tiny and one case uses it.
"""
from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import fz3
from fz3 import launch
from fz3.shell.compiled import outside_graph
from gpt import GPT, GPTConfig, loss_fn, markov_batch

C = GPTConfig(vocab=32, d_model=16, n_head=2, n_layer=2, seq=8)
PER_RANK, GAS, STEPS = 2, 2, 3
FP32 = dict(rtol=1e-5, atol=1e-6)
BF16 = dict(rtol=2e-2, atol=6e-3)  # bf16 compute against the fp32 reference (tests/test_parity.py)
DS_CONFIG = {"train_micro_batch_size_per_gpu": PER_RANK, "gradient_accumulation_steps": GAS,
             "gradient_clipping": 0.5, "zero_optimization": {"stage": 3}}


class CheckpointedGPT(GPT):
    """The GPT with each block under activation checkpointing (non-reentrant, recomputed in
    backward), compiled inside the checkpoint as torchtitan orders them (AC, then compile)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.lm_head(self.ln_f(x))


@dataclass(frozen=True)
class Case:
    backend: str
    how: str  # "block.compile" | "torch.compile(block)" | "torch.compile(model)" | "engine.compile"
    config: str = "fp32"  # "fp32" | "bf16" | "ds"
    checkpointed: bool = False
    evals: bool = False  # an eval pass (no_grad, eval mode) after every optimizer step

    def __str__(self) -> str:
        return f"{self.backend}-{self.how}-{self.config}" + ("-ac" if self.checkpointed else "")


def build(case: Case, *, compiled: bool = True) -> nn.Module:
    torch.manual_seed(0)
    net = (CheckpointedGPT if case.checkpointed else GPT)(C)
    if not compiled or case.how == "engine.compile":
        return net
    if case.how == "block.compile":
        for block in net.blocks:
            block.compile(backend=case.backend)
    else:  # torch.compile(block), also under torch.compile(model)
        for i, block in enumerate(net.blocks):
            net.blocks[i] = torch.compile(block, backend=case.backend)
        if case.how == "torch.compile(model)":
            net = torch.compile(net, backend=case.backend)
    return net


def config_of(case: Case) -> fz3.Config:
    if case.config == "ds":
        return fz3.Config.from_deepspeed(DS_CONFIG)
    return fz3.Config(param_persistence_threshold=0, gradient_accumulation_steps=GAS,
                      compute_dtype="bf16" if case.config == "bf16" else "fp32")


def batch(i: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = markov_batch(i, batch=PER_RANK * world, seq=C.seq, vocab=C.vocab)
    return x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK]


COUNTS = ("graphs", "graph_breaks", "compiled_frames")


def optimizer(net: nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum, not Adam: the attention key bias gets rounding noise for a grad (a
    softmax ignores a shift), which Adam scales up to lr-sized steps whose sign is the noise's."""
    return torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)


def train(rank: int, world: int, case: Case) -> dict:
    net = build(case)
    engine = fz3.initialize(net, optimizer(net), config_of(case))
    if case.how == "engine.compile":
        engine.compile(backend=case.backend)
    losses, counts = [], []
    for step in range(STEPS):
        for i in range(step * GAS, (step + 1) * GAS):
            x, y = batch(i, rank, world)
            loss = loss_fn(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        if case.evals:
            engine.eval()
            with torch.no_grad():
                engine(x)
            engine.train()
        s = engine.stats()
        counts.append({k: s[k] for k in COUNTS})
    return {"losses": losses, "state": engine.full_state_dict(), "counts": counts,
            "units": engine.stats()["compiled_units"], "compiled": engine.is_compiled}


def reference(case: Case, world: int) -> dict:
    """The same compiled model in one process: per micro-step each rank's slice, backward of
    loss / (W * GAS), one optimizer step per window (clipped as the config says)."""
    net = build(case, compiled=case.how != "engine.compile")
    if case.how == "engine.compile":
        for block in net.blocks:
            block.compile(backend=case.backend)
    opt = optimizer(net)
    clip = config_of(case).gradient_clipping
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        for i in range(step * GAS, (step + 1) * GAS):
            for r in range(world):
                x, y = batch(i, r, world)
                loss = loss_fn(net(x), y)
                (loss / (world * GAS)).backward()
                losses.append((i, r, loss.item()))
        nn.utils.clip_grad_norm_(net.parameters(), clip if clip > 0 else math.inf)
        opt.step()
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in net.state_dict().items()}}


def assert_parity(outs: list[dict], ref: dict, case: Case) -> None:
    tol = BF16 if case.config == "bf16" else FP32
    for i, r, loss in ref["losses"]:
        assert outs[r]["losses"][i] == pytest.approx(loss, rel=tol["rtol"], abs=tol["atol"]), (i, r)
    for out in outs:
        assert out["state"].keys() == ref["state"].keys()
        for k, v in ref["state"].items():
            torch.testing.assert_close(out["state"][k], v, **tol, msg=lambda m, k=k: f"{k}: {m}")


PARITY = [  # (case, world size)
    (Case("eager", "block.compile"), 3),
    (Case("aot_eager", "torch.compile(block)", config="bf16"), 2),
    (Case("aot_eager", "block.compile", config="ds", checkpointed=True), 3),
    (Case("aot_eager", "torch.compile(model)"), 2),
    (Case("aot_eager", "engine.compile", evals=True), 2),
    (Case("inductor", "block.compile", checkpointed=True), 3),
]


@pytest.mark.parametrize("case,world", PARITY, ids=[f"{c}-w{w}" for c, w in PARITY])
def test_compiled_blocks_train_at_parity(case, world):
    ref = reference(case, world)
    outs = launch.run_threads(train, world, args=(case,))
    assert_parity(outs, ref, case)
    for out in outs:
        assert out["units"] == C.n_layer and out["compiled"]  # each compiled block is one fetch unit
    if case.how != "torch.compile(model)":  # fz3's hooks break no graph: one graph, traced once
        assert all(c["graph_breaks"] == outs[0]["counts"][0]["graph_breaks"] for c in outs[0]["counts"])


def test_compiled_blocks_on_gloo_processes():
    """The same on 2 processes over gloo (aot_eager: inductor's compile, paid once above, would
    be paid again in each process)."""
    case = Case("aot_eager", "block.compile", checkpointed=True)
    ref = reference(case, 2)
    outs = launch.run(train, world_size=2, args=(case,), timeout=600)
    assert_parity(outs, ref, case)


def test_a_steady_state_compiles_nothing_more():
    """After the first window (train, eval, accumulation boundary all seen once), every later
    step adds no graph, no graph break and no compiled frame."""
    case = Case("aot_eager", "block.compile", evals=True)
    outs = launch.run_threads(train, 2, args=(case,))
    for out in outs:
        first, *rest = out["counts"]
        assert first["graphs"] > 0
        assert all(c == first for c in rest), out["counts"]


def in_a_rank(fn):
    """fn() on a world of one thread rank (fz3.initialize needs a rank); -> what it returns."""
    return launch.run_threads(lambda rank, world: fn(), 1)[0]


def _engine(net: nn.Module | None = None):
    net = GPT(C) if net is None else net
    return fz3.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1), fz3.Config())


def _raised(fn) -> BaseException | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - returned to the test, which checks its type and text
        return e
    return None


def test_engine_compile_compiles_the_repeated_blocks_and_says_so(caplog):
    def run():
        engine = _engine()
        engine.compile(backend="eager")
        with caplog.at_level(logging.DEBUG, logger="fz3"):
            x, y = batch(0, 0, 1)
            engine.backward(loss_fn(engine(x), y))
            engine.step()
        return engine.compiled_regions, engine.is_compiled, engine.stats()["compiled_units"]

    with caplog.at_level(logging.INFO, logger="fz3"):
        assert in_a_rank(run) == (["blocks.0", "blocks.1"], True, 2)
    assert "compiled 2 modules, each one fetch unit: blocks.0, blocks.1" in caplog.text
    assert "graph breaks" in caplog.text and "over 2 compiled units" in caplog.text


def test_engine_compile_without_blocks_compiles_the_roots_children():
    def run():
        engine = _engine(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
        engine.compile(backend="eager")
        engine.backward(engine(torch.ones(3, 4)).sum())
        engine.step()
        return engine.compiled_regions, engine.stats()["compiled_units"]

    assert in_a_rank(run) == (["0", "2"], 2)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(schedule=[(0, [])]), ValueError, "schedule of DeepCompile passes"),
    (dict(compiled_autograd_enabled=True), ValueError, "compiled autograd is not supported"),
    (dict(compile_kwargs="max-autotune"), TypeError, "expected a dict of torch.compile keyword"),
    (dict(compile_kwargs={"backend": "eager"}), ValueError, "backend given twice"),
])
def test_engine_compile_refuses_what_it_cannot_do(kwargs, error, match):
    e = in_a_rank(lambda: _raised(lambda: _engine().compile(**kwargs)))
    assert isinstance(e, error) and re.search(match, str(e)), e


def test_engine_compile_after_a_forward_is_refused():
    def run():
        engine = _engine()
        engine(batch(0, 0, 1)[0])
        return _raised(lambda: engine.compile(backend="eager"))

    e = in_a_rank(run)
    assert isinstance(e, RuntimeError) and "before the first forward" in str(e), e


def test_torch_compile_of_the_engine_says_what_to_do():
    e = in_a_rank(lambda: _raised(lambda: torch.compile(_engine(), backend="eager")(batch(0, 0, 1)[0])))
    assert isinstance(e, TypeError), e
    assert re.search(r"torch.compile\(engine\) is not supported.*engine.compile", str(e)), e


def test_a_hook_is_a_graph_break_run_without_the_compiler():
    """What outside_graph gives every fz3 hook: the compiler does not trace it (it runs eagerly,
    is_compiling() False inside, and what it calls is not compiled either), and the ops around
    it stay compiled."""
    seen = []

    def inner() -> bool:
        return torch.compiler.is_compiling()

    def hook(x):
        seen.append((torch.compiler.is_compiling(), inner()))
        return x

    hook_out = outside_graph(hook)

    @torch.compile(backend="eager")
    def f(x):
        return hook_out(x * 2) + 1

    assert torch.equal(f(torch.ones(2)), torch.full((2,), 3.0))
    assert seen == [(False, False)]
    assert torch.equal(f(torch.ones(2)), torch.full((2,), 3.0)) and len(seen) == 2
    assert not torch.compiler.is_compiling()


@pytest.mark.parametrize("how", ["block.compile", "torch.compile(block)", "set_leaf_modules"])
def test_plan_sees_the_units_the_engine_runs(how):
    """fz3.plan runs the engine on a copy of the model, and a copy keeps neither leaf marks nor
    compiled modules: the plan now has the same units (and so the same gathers) as the run, and
    compiles nothing."""
    def net() -> nn.Module:
        if how == "set_leaf_modules":
            m = build(Case("eager", "block.compile"), compiled=False)
            fz3.set_leaf_modules(m, [type(m.blocks[0])])
            return m
        return build(Case("eager", how))

    def run(rank, world):
        m = net()
        engine = fz3.initialize(m, optimizer(m), fz3.Config(param_persistence_threshold=0))
        x, y = batch(0, rank, world)
        engine.backward(loss_fn(engine(x), y))
        engine.step()
        return engine.stats()

    ran = launch.run_threads(run, 2)[0]
    before = torch._dynamo.utils.counters["frames"]["total"]
    planned = fz3.plan(net(), fz3.Config(param_persistence_threshold=0), world_size=2,
                       example_inputs=(batch(0, 0, 2)[0],), optimizer="sgd").stats
    assert torch._dynamo.utils.counters["frames"]["total"] == before  # the plan compiled nothing
    for k in ("compiled_units", "all_gather", "gathered_bytes", "reduce", "peak_live_numel"):
        assert planned[k] == ran[k], (k, planned[k], ran[k])
    assert planned["compiled_units"] == (0 if how == "set_leaf_modules" else C.n_layer)
