"""fz3.check (issue #28): the user's model on 1-3 thread ranks under drawn configs against one
process (fz3/checking/).

    a clean model       a tied weight, a block called twice, a returned param, dropout: passes on
                        W 1-3, bit for bit at W 1-2; Hugging Face as (model, example_inputs)
    planted hazards     each reported under its check with its cause: a param written in forward
                        outside autograd; control flow that differs between ranks; a buffer
                        updated in forward without broadcast_buffers; a param read through a
                        stashed reference (config-dependent: it fails only when not persistent)
    shrinking           greedy to a fixed point (a pure table); on a real failure the printed
                        fz3.Config(...) evaluates to a config that fails and every one-step-simpler
                        example passes
    drawing             the same seed draws the same examples
    bad input           CheckInputError naming what was expected (the CLI: tests/test_cli.py)

The functions `clean`, `written`, `huge` and `raises_in_forward` are build()s the CLI tests name
as tests/test_check.py:FUNCTION.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import fz3
from fz3.checking import draw as check_draw
from fz3.checking.check import Runner, Settings
from fz3.checking.build import CheckInputError, numels, take
from fz3.checking.compare import Tolerance, compare
from fz3.checking.draw import Example, Space, config_source, draw, neighbours, shrink
from fz3.checking.run import Reference, RankRun

pytestmark = pytest.mark.timeout(120)


# ---- models ---------------------------------------------------------------------------------------

class Scale(nn.Module):
    """Returns its own param: the caller computes with it (an external param of the caller)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self):
        return self.weight


class Clean(nn.Module):
    """Tied embedding and head, a block called twice, a returned param, dropout (the ranks draw
    their masks as the reference does); `stash`: the head also reads block.weight through a
    list, where fz3's hooks cannot see it (fine while the param is persistent)."""

    def __init__(self, stash: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(7, 6)
        self.block = nn.Linear(6, 6)
        self.scale = Scale(6)
        self.drop = nn.Dropout(0.25)
        self.head = nn.Linear(6, 7, bias=False)
        self.head.weight = self.emb.weight
        self.stashed = [self.block.weight] if stash else []

    def forward(self, ids):
        h = self.emb(ids)  # (B, T, 6)
        h = torch.tanh(self.block(torch.tanh(self.block(h))))
        h = self.drop(h) * self.scale()
        for w in self.stashed:
            h = h + h @ w
        return self.head(h)  # (B, T, 7)


def _token_batches(n: int = 2, rows: int = 6):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 7, (rows, 5), generator=g) for _ in range(n)]


def _next_token_loss(model, ids):
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, 7), ids[:, 1:].reshape(-1))


def clean():
    return Clean(), _token_batches(), _next_token_loss


def stashed():
    return Clean(stash=True), _token_batches(), _next_token_loss


class Written(nn.Module):
    """Writes its param in place in forward, outside autograd."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.gain = nn.Parameter(torch.ones(4))

    def forward(self, x):
        with torch.no_grad():
            self.gain.mul_(0.9)
        return self.lin(x) * self.gain


def _float_batches(n: int = 2, rows: int = 6):
    g = torch.Generator().manual_seed(2)
    return [torch.randn(rows, 4, generator=g) for _ in range(n)]


def _mse(model, x):
    return model(x).square().mean()


def written():
    return Written(), _float_batches(), _mse


class Branchy(nn.Module):
    """Runs `extra` on a slice whose first feature sums above 0: a choice each rank makes alone."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.extra, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = self.a(x)
        if x[:, 0].sum() > 0:
            h = self.extra(h)
        return self.head(h)


class Counter(nn.Module):
    """A buffer updated in forward from the data, read by the output."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.register_buffer("seen", torch.zeros(4))

    def forward(self, x):
        self.seen += x.detach().mean(0)
        return self.lin(x) + self.seen


def huge():
    """A model whose check would need far more than 20 GiB (built on the meta device: no memory)."""
    return nn.Linear(100_000, 100_000, device="meta"), torch.zeros(6, 100_000)


class NeedsAGPU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        raise RuntimeError("Found no NVIDIA driver on your system")


def raises_in_forward():
    return NeedsAGPU(), torch.zeros(6, 4)


# ---- the clean model passes -------------------------------------------------------------------------

def test_a_clean_model_passes_on_one_to_three_ranks():
    report = fz3.check(clean, examples=6)
    assert report.ok, report.summary()
    assert [r.example.world_size for r in report.results] == [1, 2, 3, 1, 2, 3]
    assert all(r.exact for r in report.results if r.example.world_size < 3), report.summary()
    text = report.summary()
    assert "OK: 6 examples passed" in text and "determinism" in text and "I1 live budget" in text
    assert not report.failures and not report.warnings


def test_a_hugging_face_model_as_model_and_example_inputs_passes():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)

    def build():
        torch.manual_seed(0)
        ids = torch.randint(0, 64, (4, 8))
        return transformers.LlamaForCausalLM(cfg), {"input_ids": ids, "labels": ids}

    report = fz3.check(build, world_sizes=(1, 2), examples=3)
    assert report.ok, report.summary()
    assert report.derived_loss and "derived from the output" in report.summary()


def test_bf16_is_drawn_when_asked_and_its_reference_computes_in_bf16_too():
    report = fz3.check(clean, world_sizes=(1, 2), examples=8, bf16=True)
    assert report.ok, report.summary()
    bf16 = [r for r in report.results if r.example.config.compute_dtype == "bf16"]
    assert any(r.example.world_size == 2 for r in bf16) and all(r.exact for r in bf16), report.summary()
    assert report.tolerance["bf16"] == (2e-2, 6e-3)
    unasked = fz3.check(clean, world_sizes=(1,), examples=8).results
    assert all(r.example.config.compute_dtype == "fp32" for r in unasked)


# ---- planted hazards, each with its cause ----------------------------------------------------------

def test_a_param_written_in_forward_outside_autograd_is_named():
    report = fz3.check(written, examples=3)
    assert not report.ok
    first = report.failures[0]
    assert first.check in ("params", "losses") and first.step == 1, report.summary()
    assert "'gain'" in first.cause and "outside autograd" in first.cause
    assert str(first).startswith(f"{first.check}: step 1") and "on W=" in str(first) and "likely cause" in str(first)
    shrunk = report.results[0].shrunk.example
    assert (shrunk.world_size, shrunk.steps, shrunk.config) == (1, 1, fz3.Config())


def test_control_flow_that_differs_between_ranks_is_a_divergence_naming_the_module():
    x = torch.tensor([[1.0] * 4] * 3 + [[-1.0] * 4] * 3)  # rank 0's rows positive, rank 1's negative
    report = fz3.check(lambda: (Branchy(), [x], _mse), world_sizes=(1, 2), examples=2)
    assert report.results[0].ok and not report.results[1].ok
    failure = report.results[1].failures[0]
    assert failure.check == "divergence" and failure.micro_step == 0, report.summary()
    assert "DivergenceError" in failure.detail
    assert "differs between ranks" in failure.cause and "'extra'" in failure.cause and "leaf" in failure.cause


def test_a_buffer_updated_in_forward_without_broadcast_buffers_is_named():
    own = fz3.check(lambda: (Counter(), _float_batches(), _mse), world_sizes=(2,), examples=1,
                    options=fz3.Options(broadcast_buffers=False))
    failure = own.failures[0]
    assert (failure.check, failure.name, failure.rank, failure.micro_step) == ("buffers", "seen", 1, 1), own.summary()
    assert "differs between ranks" in failure.cause and "broadcast_buffers=True" in failure.cause
    broadcast = fz3.check(lambda: (Counter(), _float_batches(), _mse), world_sizes=(2,), examples=1)
    assert broadcast.ok, broadcast.summary()
    assert any("buffers updated in forward (seen)" in w for w in broadcast.warnings)


def test_a_param_read_through_a_stashed_reference_is_named_and_its_config_shrunk():
    report = fz3.check(stashed, examples=12)
    assert [r.index for r in report.results if not r.ok] and all(r.ok for r in report.results[:3]), report.summary()
    failure = report.failures[0]
    assert failure.check == "error" and failure.step == 1 and failure.micro_step == 0
    assert "read param 'block.weight' while fz3 had it released" in failure.cause
    for r in report.results:  # persistent (the threshold holds the weight): passes; else fails
        kept = r.example.config.param_persistence_threshold >= 36
        assert r.ok == kept, (r.index, r.example)


def test_data_dependent_order_between_passes_passes_with_a_warning():
    class Sign(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.a, self.pos, self.neg, self.head = (nn.Linear(4, 4) for _ in range(4))

        def forward(self, x):
            h = self.a(x)
            return self.head(self.pos(h) if x.mean() > 0 else self.neg(h))

    batches = [torch.rand(6, 4) + 0.1, -torch.rand(6, 4) - 0.1]  # every rank's slice has the batch's sign
    report = fz3.check(lambda: (Sign(), batches, _mse), examples=3)
    assert report.ok, report.summary()
    assert any("module order depends on the data" in w and "'neg'" in w and "'pos'" in w for w in report.warnings)


def test_a_second_run_that_differs_is_a_determinism_failure(monkeypatch):
    """The second run of an example emits another effect on rank 0 (planted): named, with where."""
    from fz3.checking import check as check_module
    calls = []
    real = check_module.on_ranks

    def twice(subject, job):
        runs = real(subject, job)
        calls.append(job)
        if len(calls) == 2:
            effects = runs[0].effects[1]
            effects[3], effects[4] = effects[4], effects[3]
        return runs

    monkeypatch.setattr(check_module, "on_ranks", twice)
    report = fz3.check(clean, world_sizes=(2,), examples=1)
    failure = report.failures[0]
    assert (failure.check, failure.micro_step, failure.rank) == ("determinism", 1, 0), report.summary()
    assert "effect 3 of the micro-step" in failure.detail and "something besides the inputs" in failure.cause


def test_a_core_that_prefetches_past_the_budget_fails_I1(monkeypatch):
    """Planted: the watch holds the ranks to a live budget of 0 while their core prefetches up to
    the config's 1e9, as a core ignoring max_live_parameters would."""
    from fz3.checking import watch as check_watch
    real = check_watch.Watch.__init__

    def tight(self, engine):
        real(self, engine)
        self.budget = 0

    monkeypatch.setattr(check_watch.Watch, "__init__", tight)
    report = fz3.check(clean, world_sizes=(2,), examples=1, config=fz3.Config(param_persistence_threshold=0))
    failure = report.failures[0]
    assert failure.check == "I1 live budget", report.summary()
    assert "over max_live_parameters=0" in failure.detail and "micro-step 1" in failure.detail  # prefetch: pass 2


def test_a_core_that_prefetches_past_its_reach_fails_the_reach_check(monkeypatch):
    """Planted: the watch holds the ranks to a prefetch bucket of 0 while their core prefetches a
    bucket of 5e7 ahead (the whole model at the forward's first fetch), as a core walking past its
    reach would."""
    from fz3.checking import watch as check_watch
    real = check_watch.Watch.__init__

    def short(self, engine):
        real(self, engine)
        self.config = engine.config.replace(prefetch_bucket_size=0)

    monkeypatch.setattr(check_watch.Watch, "__init__", short)
    report = fz3.check(clean, world_sizes=(2,), examples=1, config=fz3.Config(param_persistence_threshold=0))
    failure = report.failures[0]
    assert failure.check == "prefetch reach", report.summary()
    assert "more than prefetch_bucket_size=0 plus one param" in failure.detail and "micro-step 1" in failure.detail


def test_counters_left_after_a_backward_fail_I2(monkeypatch):
    from fz3.core.param.invariants import InvariantError
    from fz3.checking import watch as check_watch

    def planted(state):
        raise InvariantError("module block has pre_backward=1, grads_remaining=0 after the pass")

    monkeypatch.setattr(check_watch, "check_quiescent", planted)
    report = fz3.check(clean, world_sizes=(1,), examples=1)
    assert [(f.check, f.rank) for f in report.failures] == [("I2 counts", 0)]
    assert "micro-step 0, after the backward: module block has pre_backward=1" in report.failures[0].detail


# ---- shrinking -------------------------------------------------------------------------------------

BASE = fz3.Config()
SPACE = Space.around(BASE, (1, 2, 3), 3, [10, 100, 1000], bf16=False)
DRAWN = Example(3, 3, BASE.replace(reduce_bucket_size=1, param_persistence_threshold=0, overlap_comm=False,
                                   gradient_accumulation_steps=2))


@pytest.mark.parametrize("fails, want", [
    (lambda e: e.config.reduce_bucket_size == 1, Example(1, 1, BASE.replace(reduce_bucket_size=1))),
    (lambda e: e.world_size >= 2 and e.config.param_persistence_threshold == 0 and e.steps >= 2,
     Example(2, 2, BASE.replace(param_persistence_threshold=0))),
    (lambda e: not e.config.overlap_comm and e.config.gradient_accumulation_steps == 2,
     Example(1, 1, BASE.replace(overlap_comm=False, gradient_accumulation_steps=2))),
    (lambda e: True, Example(1, 1, BASE)),
])
def test_shrinking_is_greedy_to_a_fixed_point(fails, want):
    got = shrink(DRAWN, SPACE, fails)
    assert got.example == want and got.minimal
    assert fails(got.example) and not any(fails(n) for n in neighbours(got.example, SPACE))


def test_shrinking_stops_at_its_budget_and_says_so():
    got = shrink(DRAWN, SPACE, lambda e: True, budget=2)
    assert got.runs == 2 and not got.minimal


def test_the_printed_config_fails_and_every_one_step_simpler_example_passes():
    report = fz3.check(stashed, examples=12)
    bad = next(r for r in report.results if r.shrunk is not None)
    printed = config_source(bad.shrunk.example.config)
    assert printed in report.summary()
    config = eval(printed, {"fz3": fz3})  # noqa: S307 - the text the user is told to paste
    assert config == bad.shrunk.example.config and config != fz3.Config()
    runner = Runner(take(stashed), Settings(examples=12), fz3.initialize)
    space = Space.around(fz3.Config(), (1, 2, 3), 2, numels(take(stashed).model), bf16=False)
    example = Example(bad.shrunk.example.world_size, bad.shrunk.example.steps, config)
    assert runner.outcome(example).failures
    simpler = neighbours(example, space)
    assert simpler and all(not runner.outcome(n).failures for n in simpler), simpler


# ---- drawing ---------------------------------------------------------------------------------------

def test_the_same_seed_draws_the_same_examples():
    space = Space.around(BASE, (1, 2, 3), 2, [8, 64, 4096], bf16=True)
    a, b = draw(space, 7, 20), draw(space, 7, 20)
    assert a == b and draw(space, 7, 5) == a[:5] and draw(space, 8, 20) != a
    assert [e.config for e in a[:3]] == [BASE] * 3 and [e.world_size for e in a[:4]] == [1, 2, 3, 1]
    fields = {name for e in a for name in check_draw.drawn_fields(e.config, BASE)}
    assert fields == set(check_draw.FIELDS), fields  # 17 drawn examples reach every field


@pytest.mark.parametrize("config", [
    fz3.Config(),
    fz3.Config(param_persistence_threshold=0, reduce_bucket_size=7, contiguous_gradients=False),
    fz3.Config(compute_dtype="bf16", gradient_clipping=0.5, leaf_module_classes=("Block",)),
])
def test_a_printed_config_round_trips_through_eval(config):
    assert eval(config_source(config), {"fz3": fz3}) == config  # noqa: S307


# ---- bad input -------------------------------------------------------------------------------------

def _bad_loss(model, x):
    return model(x)  # (B, 4): not a scalar


@pytest.mark.parametrize("build, kwargs, message", [
    (42, {}, "takes a function build()"),
    (lambda: 1 / 0, {}, "build() raised ZeroDivisionError"),
    (lambda: nn.Linear(2, 2), {}, "build() must return (model, example_batches, loss_fn) or (model, example_inputs)"),
    (lambda: (nn.Linear(4, 4), [], _mse), {}, "example_batches must be a non-empty list"),
    (lambda: (nn.Linear(4, 4), _float_batches(), "mse"), {}, "loss_fn must be callable"),
    (lambda: (nn.Linear(4, 4), _float_batches(), _bad_loss), {}, "expected a scalar floating loss"),
    (lambda: (nn.Linear(4, 4), _float_batches(), lambda m, x: m(x).sum().detach()), {},
     "does not require grad"),
    (lambda: (nn.Linear(4, 4), (torch.zeros(6, 3),)), {}, "does not run in one process on the CPU"),
    (raises_in_forward, {}, "does not run in one process on the CPU: model(*example_inputs) raised RuntimeError"),
    (lambda: (nn.Linear(4, 4, device="meta"), torch.zeros(6, 4)), {}, "on the meta device"),
    (lambda: (nn.Linear(4, 4).double(), torch.zeros(6, 4, dtype=torch.float64)), {},
     "param 'weight' is torch.float64: fz3 keeps fp32 master shards"),
    (huge, {}, "too big to check in one process here"),
    (lambda: (nn.Linear(4, 4), torch.zeros(5, 4)), {"world_sizes": (2, 3)}, "no world size in [2, 3] divides"),
    (clean, {"examples": 0}, "examples must be an int >= 1"),
    (clean, {"config": "ds.json"}, "config must be a fz3.Config"),
])
def test_bad_input_names_what_was_expected(build, kwargs, message):
    with pytest.raises(CheckInputError) as e:
        fz3.check(build, **kwargs)
    assert message in str(e.value), str(e.value)


def test_too_big_suggests_the_plan():
    with pytest.raises(CheckInputError, match=r"GiB.*python -m fz3 plan"):
        fz3.check(huge)


def test_a_world_size_the_batch_does_not_divide_is_skipped_and_said():
    report = fz3.check(lambda: (Written(), [torch.zeros(4, 4)], _mse), examples=2)
    assert [r.example.world_size for r in report.results] == [1, 2]
    assert any("W=3" in s and "do not divide" in s for s in report.skipped), report.summary()
    assert "not checked:" in report.summary()


def test_a_loss_that_is_not_finite_is_undecided_not_a_pass():
    nan = [torch.full((6, 4), math.nan)]
    report = fz3.check(lambda: (nn.Linear(4, 1), nan, _mse), world_sizes=(1, 2), examples=2)
    assert not report.failures and not report.ok, report.summary()
    assert any("the loss is not finite in one process" in u for u in report.undecided)


def test_nothing_on_two_ranks_is_undecided_not_a_pass():
    report = fz3.check(clean, world_sizes=(1, 2), examples=1)
    assert not report.failures and not report.ok and report.undecided
    assert "UNDECIDED" in report.summary()


# ---- the comparison alone --------------------------------------------------------------------------

def _runs(losses: list[float], effects: list) -> list[RankRun]:
    run = RankRun(0, losses=list(losses), effects={0: list(effects)})
    return [run]


def test_compare_names_the_first_loss_beyond_the_tolerance():
    ex = Example(1, 1, fz3.Config())
    ref = Reference(losses=[[1.0]])
    ok = compare(ex, ref, _runs([1.0 + 1e-6], []), None, Tolerance(1e-5, 0.0), [], True)
    assert not ok.failures and not ok.exact and ok.loss_dev == pytest.approx(1e-6)
    bad = compare(ex, ref, _runs([1.1], []), None, Tolerance(1e-5, 0.0), [], True)
    assert [(f.check, f.step, f.rank) for f in bad.failures] == [("losses", 1, 0)]
    assert "1.1 on the ranks, 1.0 in one process" in bad.failures[0].detail
    replaced = dataclasses.replace(ex, steps=2)
    assert "W=1, 2 steps" in replaced.describe(fz3.Config())
