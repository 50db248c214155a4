"""fz3.plan against real runs: for a model whose call order does not depend on its data, every
figure the plan shares with engine.stats() equals it after the same steps on 1-3 gloo ranks
(fz3/observe/plan.py); and the plan itself: any world size in one process, the user's model left
alone, bad input named; models that make tensors without a device and read their data, known
values read exactly and the rest guessed and listed (fz3/observe/fake.py); Hugging Face models as
they come (default attention, no mask) when transformers is installed."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fz3
from fz3 import launch

pytestmark = pytest.mark.timeout(400)

CONFIGS = [
    {"param_persistence_threshold": 0},
    {"reduce_bucket_size": 3000, "max_live_parameters": 2000, "prefetch_bucket_size": 1500,
     "max_reuse_distance": 0},
    {"reduce_scatter": False, "gradient_accumulation_steps": 2, "param_persistence_threshold": 200},
    {"contiguous_gradients": False, "reduce_bucket_size": 5000, "compute_dtype": "bf16"},
]


def _gpt():
    from gpt import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=64, d_model=32, n_head=4, n_layer=2, seq=8))


class Frozen(nn.Module):
    """A frozen layer, a layer called twice, a tied pair and a head never called (no grad, so
    the optimizer keeps no state for it: [Note: no grad, no step])."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 16)
        self.a.requires_grad_(False)
        self.unused = nn.Linear(16, 4)
        self.d = nn.Linear(16, 16, bias=False)
        self.e = nn.Linear(16, 16, bias=False)
        self.e.weight = self.d.weight

    def forward(self, x):
        return self.e(self.d(self.c(self.b(self.b(self.a(x)).relu()))))


class ArangeGPT(nn.Module):
    """nanoGPT's embedding, its positions made in forward without a device, as many GPTs do."""

    def __init__(self, vocab: int = 64, d: int = 32, seq: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.mlp, self.head = nn.Linear(d, d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        B, T = idx.shape
        x = self.tok(idx) + self.pos(torch.arange(T))  # (B, T, C): arange on the default device
        return self.head(self.mlp(x).relu())  # (B, T, vocab)


class Routed(nn.Module):
    """Reads its data: a check of the inputs (known: no guess) and a router whose choice comes
    from the params (guessed: every expert gets every token, which this data also does); its
    positions made without a device."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.pos, self.router = nn.Embedding(16, 8), nn.Embedding(8, 8), nn.Linear(8, 2)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, idx):
        if not (idx < 16).all():  # the inputs' values: known
            raise ValueError("a token out of range")
        x = self.emb(idx) + self.pos(torch.arange(idx.shape[1]))  # (B, T, C)
        probs = self.router(x).softmax(-1)  # (B, T, E): from the params
        choice = probs.argmax(-1)  # (B, T)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            mask = choice == e
            if mask.any():  # ROUTED_READ: guessed True
                out[mask] = expert(x[mask]) * probs[mask][:, e:e + 1]  # (N, C): the mask guessed all True
        return out


def routed():
    """(model, example_inputs) for `python -m fz3 plan tests/test_plan.py:routed` (its guesses)."""
    return _case("routed")[:2]


ROUTED_READ = next(i + 1 for i, line in enumerate(open(__file__)) if "# ROUTED_READ" in line)


def _case(name: str):
    from gpt import loss_fn, markov_batch
    if name in ("gpt", "arange"):
        x, y = markov_batch(0, batch=2, seq=8, vocab=64)
        return (_gpt() if name == "gpt" else ArangeGPT()), (x, y), lambda out: loss_fn(out, y)
    if name == "routed":
        x = torch.randint(0, 16, (4, 8), generator=torch.Generator().manual_seed(2))
        return Routed(), (x,), lambda out: out.square().mean()
    if name == "llama":  # Hugging Face, sdpa, no mask: the loss from labels
        return _llama(), {"input_ids": IDS, "labels": IDS}, lambda out: out.loss
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    return Frozen(), (x,), lambda out: out.square().mean()


CASES = ([(name, options, steps) for name in ("gpt", "frozen") for options in CONFIGS for steps in (1, 2)]
         + [(name, CONFIGS[i], 2) for name in ("arange", "routed") for i in (1, 3)]
         + [("gpt", {"param_persistence_threshold": 0, "module_granularity_threshold": 1569}, 2)])
"""Static models under every config; those that make tensors without a device or read their
data (the fake-tensor cases, fz3/observe/fake.py) under two; the GPT with the granularity
threshold that makes it one leaf (its root's granularity is 1,569: fz3/core/granularity.py)."""


def _cases(world: int) -> list:
    """CASES, and on 2 ranks a Hugging Face Llama as it comes where transformers is installed."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return CASES
    return CASES + ([("llama", {"param_persistence_threshold": 0}, 2)] if world == 2 else [])


def _real_all(rank: int, world: int) -> list[dict]:
    return [_real(name, options, steps) for name, options, steps in _cases(world)]


def _real(name: str, options: dict, steps: int) -> dict:
    model, inputs, loss_of = _case(name)
    config = fz3.Config(**options)
    engine = fz3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
    for _ in range(steps):
        for _ in range(config.gradient_accumulation_steps):
            engine.backward(loss_of(engine(**inputs) if isinstance(inputs, dict) else engine(inputs[0])))
            engine.step()  # every micro-step: the window closes at the gas-th
    return engine.stats()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_plan_is_what_a_real_run_counts(world):
    """The plan, made once here (it needs no process group and is every rank's), against each
    rank's engine.stats() after the same steps."""
    reals = launch.run(_real_all, world_size=world, timeout=300)
    for i, (name, options, steps) in enumerate(_cases(world)):
        model, inputs, _ = _case(name)
        planned = fz3.plan(model, fz3.Config(**options), world_size=world, example_inputs=inputs, steps=steps,
                           backend="gloo")
        per_step = planned.steps
        for rank, real in enumerate(r[i] for r in reals):
            assert set(planned.stats) <= set(real), set(planned.stats) - set(real)
            diff = {k: (v, real[k]) for k, v in planned.stats.items() if real[k] != v}
            assert not diff, f"{name} {options} world {world} rank {rank} steps {steps}: plan != real {diff}"
            assert sum(s["all_gather"] for s in per_step) == real["all_gather"]
            assert sum(s["reduced_bytes"] for s in per_step) == real["reduced_bytes"]
            assert max(s["peak_live_numel"] for s in per_step) == real["peak_live_numel"]


def test_64_ranks_in_one_process_and_the_model_untouched():
    """No process group; the user's model keeps its params, values and hooks; the shards are
    ceil(numel / 64) per param."""
    model, inputs, _ = _case("gpt")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    p = fz3.plan(model, fz3.Config(param_persistence_threshold=0), world_size=64, example_inputs=inputs,
                 steps=2, backend="gloo")
    assert list(model.parameters()) == params and all(x.device.type == "cpu" for x in params)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    unique = {id(x): x for x in params}.values()
    assert p.stats["param_shards"] == sum(-(-x.numel() // 64) * 4 for x in unique)
    assert p.params == sum(x.numel() for x in unique)
    first, second = p.steps
    assert first["all_gather_prefetch"] == 0 < second["all_gather_prefetch"]  # the trace, from step 2
    assert p.stats["trace"] == "COMPLETE"
    assert "step 2" in p.table() and "64 ranks" in p.table()


def test_optimizer_state_is_the_optimizers_own():
    """AdamW: two fp32 moments per element and a step counter per param; SGD without momentum:
    nothing; SGD with momentum: one buffer per element. None for the head never called (no
    grad, never stepped)."""
    model, inputs, _ = _case("frozen")
    unused = {id(p) for p in model.unused.parameters()}
    trainable = [x for x in {id(x): x for x in model.parameters()}.values() if x.requires_grad and id(x) not in unused]
    shard = [-(-x.numel() // 4) for x in trainable]
    kw = dict(world_size=4, example_inputs=inputs, backend="gloo")
    adamw = fz3.plan(model, None, **kw).stats["optimizer_state_bytes"]
    assert adamw == sum(8 * s + 4 for s in shard)
    assert fz3.plan(model, None, optimizer="sgd", **kw).stats["optimizer_state_bytes"] == 0
    momentum = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)
    assert fz3.plan(model, None, optimizer=momentum, **kw).stats["optimizer_state_bytes"] == sum(4 * s for s in shard)


@pytest.mark.parametrize("kwargs, message", [
    ({"world_size": 0}, "world_size must be an int >= 1, got 0"),
    ({"world_size": "2"}, "world_size must be an int >= 1, got '2'"),
    ({"world_size": 2, "steps": 0}, "steps must be an int >= 1, got 0"),
    ({"world_size": 2, "optimizer": "lion"}, "optimizer must be one of adamw, adam, sgd"),
    ({"world_size": 2, "backend": "mpi"}, "backend must be gloo, nccl or hccl"),
    ({"world_size": 2, "example_inputs": "tokens"}, "example_inputs must be a tuple"),
])
def test_bad_input_is_named(kwargs, message):
    model, inputs, _ = _case("gpt")
    with pytest.raises((ValueError, TypeError), match=message):
        fz3.plan(model, fz3.Config(), **{"example_inputs": inputs, **kwargs})


def test_a_config_that_is_not_one_is_named():
    model, inputs, _ = _case("gpt")
    with pytest.raises(TypeError, match="expects a fz3.Config"):
        fz3.plan(model, {"stage": 3}, world_size=2, example_inputs=inputs)


def test_a_model_that_reads_its_data_is_planned_and_each_guess_listed():
    """Routed: its check of the inputs is read exactly (no guess); the router's mask is guessed,
    at the line that reads it, once per expert and micro-step, in forward and in backward."""
    model, inputs, _ = _case("routed")
    p = fz3.plan(model, fz3.Config(param_persistence_threshold=0), world_size=8, example_inputs=inputs, steps=2,
                 backend="gloo")
    got = {(g.op, g.value, g.where.rsplit("test_plan.py:", 1)[-1], g.modules, g.times) for g in p.guesses}
    assert got == {("aten._local_scalar_dense.default", "True", str(ROUTED_READ), ("",), 4),
                   ("aten.nonzero.default", "every element nonzero", str(ROUTED_READ + 1), ("",), 8),
                   ("aten.nonzero.default", "every element nonzero", "backward", (), 4)}
    table = p.table()
    assert f"guessed: {len(p.guesses)} data-dependent read(s)" in table and f"test_plan.py:{ROUTED_READ}" in table


def test_a_plan_with_nothing_guessed_says_nothing_more():
    model, inputs, _ = _case("gpt")
    p = fz3.plan(model, fz3.Config(), world_size=2, example_inputs=inputs, backend="gloo")
    assert p.guesses == [] and "guessed" not in p.table()


def test_a_read_in_fz3s_own_code_is_answered_and_not_listed():
    """The engine reading a grad norm (fz3/shell/engine.py) is fz3's, not the model's."""
    from types import SimpleNamespace
    from fz3.shell.engine import Engine
    from fz3.observe.fake import Fakes
    fakes, ones = Fakes(nn.Linear(4, 1)), torch.ones(2, 4)
    with fakes:
        (x,), _ = fakes.inputs((ones,), {})
        y = fakes.model(x).sum()  # from the params: not known
        assert Engine.get_global_grad_norm(SimpleNamespace(grad_norm=y.detach(), norm_reported=y.detach())) == 1.0
        assert bool(y > 0)  # this file's: the model's
        assert int(x.sum()) == 8  # known from the inputs: no guess
    assert fakes.mode.own == 1
    assert [(g.value, g.where.rsplit(":", 1)[0].endswith("test_plan.py")) for g in fakes.guesses()] == [("True", True)]


def _llama(layers: int = 2, width: int = 64, attn: str | None = None, **extra):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=128, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False,
                      **({"attn_implementation": attn} if attn else {}), **extra)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))  # (B, T)
PADDED = torch.ones(2, 16, dtype=torch.long).index_fill_(1, torch.arange(4), 0)  # left padding


def test_hugging_face_causal_lms_as_they_come():
    """Default attention (sdpa) with no mask, with a padded mask, eager with a mask: one plan, no
    guess (transformers' mask code sees fake tensors and takes its general path); GPT-2 the same;
    a Mixtral MoE whose experts loop over the routing guesses its nonzero, named where it is."""
    transformers = pytest.importorskip("transformers")
    kw = dict(world_size=8, steps=2, backend="gloo")
    cfg = fz3.Config(param_persistence_threshold=0)
    sdpa = _llama()
    assert sdpa.config._attn_implementation == "sdpa"
    plans = [fz3.plan(sdpa, cfg, example_inputs={"input_ids": IDS, "labels": IDS}, **kw),
             fz3.plan(sdpa, cfg, example_inputs={"input_ids": IDS, "attention_mask": PADDED, "labels": IDS}, **kw),
             fz3.plan(_llama(attn="eager"), cfg, example_inputs={"input_ids": IDS, "attention_mask": PADDED}, **kw)]
    assert all(p.stats == plans[0].stats and p.guesses == [] for p in plans), [p.guesses for p in plans]
    assert all(x.device.type == "cpu" for x in sdpa.parameters())
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4,
                                                                n_positions=32))
    assert fz3.plan(gpt2, cfg, example_inputs={"input_ids": IDS, "labels": IDS}, **kw).guesses == []
    moe = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, experts_implementation="eager"))
    guesses = fz3.plan(moe, cfg, example_inputs={"input_ids": IDS, "labels": IDS}, **kw).guesses
    assert guesses and {g.op for g in guesses} == {"aten.nonzero.default"}
    assert all("mixtral/modeling_mixtral.py:" in g.where for g in guesses)
    assert guesses[0].modules == ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts")


def test_a_7b_wide_layer_plans_without_its_memory():
    """One layer of Llama-7B's shape (hidden 4096, MLP 11008, vocab 32000: 0.46 B params, 1.7 GiB
    in fp32) built on meta, planned at 64 ranks with its default attention: the process's peak
    RSS grows by far less than the params would take (bench/diagnostics/plan_check.py --llama-7b: all 32)."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM
    from fz3.shell.device import CpuDevice
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=1,
                                             num_attention_heads=32, vocab_size=32000, use_cache=False))
    ids = torch.randint(0, 32000, (1, 128))
    device = CpuDevice()
    device.reset_peak_memory_stats()
    before = device.memory_allocated()
    p = fz3.plan(model, fz3.Config(), world_size=64, example_inputs={"input_ids": ids, "labels": ids}, backend="nccl")
    grown = device.max_memory_allocated() - before
    assert p.params == sum(x.numel() for x in model.parameters()) > 4 * 10**8 and p.guesses == []
    assert grown < 2**28, f"planning grew the peak RSS by {grown / 2**20:.0f} MiB"
