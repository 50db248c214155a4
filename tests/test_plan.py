"""fz3.plan against real runs: for a model whose call order does not depend on its data, every
figure the plan shares with engine.stats() equals it after the same steps on 1-3 gloo ranks
(fz3/shell/plan.py); and the plan itself: any world size in one process, the user's model left
alone, bad input named."""
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
    from fz3.testing.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=64, d_model=32, n_head=4, n_layer=2, seq=8))


class Frozen(nn.Module):
    """A frozen layer, a layer called twice and a tied pair."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 16)
        self.a.requires_grad_(False)
        self.d = nn.Linear(16, 16, bias=False)
        self.e = nn.Linear(16, 16, bias=False)
        self.e.weight = self.d.weight

    def forward(self, x):
        return self.e(self.d(self.c(self.b(self.b(self.a(x)).relu()))))


def _case(name: str):
    from fz3.testing.gpt import loss_fn, markov_batch
    if name == "gpt":
        x, y = markov_batch(0, batch=2, seq=8, vocab=64)
        return _gpt(), (x, y), lambda out: loss_fn(out, y)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    return Frozen(), (x,), lambda out: out.square().mean()


def _compare_all(rank: int, world: int) -> list:
    return [(name, options, steps, *_compare(name, options, steps, world))
            for name in ("gpt", "frozen") for options in CONFIGS for steps in (1, 2)]


def _compare(name: str, options: dict, steps: int, world: int):
    model, inputs, loss_of = _case(name)
    config = fz3.Config(**options)
    planned = fz3.plan(model, config, world_size=world, example_inputs=inputs, steps=steps, backend="gloo")
    engine = fz3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
    for _ in range(steps):
        for _ in range(config.gradient_accumulation_steps):
            engine.backward(loss_of(engine(inputs[0])))
        engine.step()
    return planned.stats, engine.stats(), planned.steps


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_plan_is_what_a_real_run_counts(world):
    for rank, cases in enumerate(launch.run(_compare_all, world_size=world, timeout=300)):
        for name, options, steps, plan_stats, real, per_step in cases:
            assert set(plan_stats) <= set(real), set(plan_stats) - set(real)
            diff = {k: (v, real[k]) for k, v in plan_stats.items() if real[k] != v}
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
    nothing; SGD with momentum: one buffer per element."""
    model, inputs, _ = _case("frozen")
    trainable = [x for x in {id(x): x for x in model.parameters()}.values() if x.requires_grad]
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
