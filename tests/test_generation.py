"""engine.generation(budget_bytes) (issue #50, point 3; fz3/shell/generation.py): a decode loop
whose forwards read the kept units whole.

    tokens     greedy decoding on 2 thread ranks gives the unsharded model's tokens: the whole
               model kept, a budget that keeps some units, and no block at all
    messages   with the whole model kept, the decode loop sends no message between ranks; within
               a budget, a forward gathers the units left out and nothing else
    training   a generation between two training steps leaves training bit for bit as without it
    errors     inside a backward, a budget smaller than any layer, a budget that is not bytes,
               nested blocks
    HF         transformers' LlamaForCausalLM.generate (greedy) under fz3 gives its unsharded tokens
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fz3
from fz3 import launch
from fz3.interpreters import threads

pytestmark = pytest.mark.timeout(300)

VOCAB, D, STEPS = 29, 16, 6


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
                                    for _ in range(3))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        for b in self.blocks:
            x = x + b(x).cumsum(1) / (1 + torch.arange(x.shape[1], dtype=x.dtype)[:, None])
        return self.head(self.norm(x))


def greedy(model, ids: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], 1)
    return ids


def _prompt(rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(10 + rank))


def _engine(model: nn.Module):
    return fz3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), fz3.Config(param_persistence_threshold=0))


def _sent() -> int:
    return sum(threads.current().world.sends.values())


def _decode(rank: int, world: int, budget) -> dict:
    model = TinyLM()
    engine = _engine(model)
    engine.eval()
    with torch.no_grad():
        greedy(engine, _prompt(rank), 1)  # a forward first: the trace is recorded (as after training)
        before_gathers = engine.stats()["all_gather"]
        if budget == "off":
            before = _sent()
            out = greedy(engine, _prompt(rank), STEPS)
            info = None
        else:
            with engine.generation(budget_bytes=budget) as info:
                before = _sent()
                g0 = engine.stats()["all_gather"]
                out = greedy(engine, _prompt(rank), STEPS)
                gathers = engine.stats()["all_gather"] - g0
            info = dict(info, gathers=gathers)
        sent = _sent() - before
    return {"tokens": out, "sent": sent, "info": info, "gathers_before": before_gathers,
            "live_after": engine.stats()["live_numel"]}


@pytest.mark.parametrize("budget", [None, 3_000, "off"])
def test_greedy_tokens_are_the_unsharded_models(budget):
    outs = launch.run_threads(_decode, 2, args=(budget,))
    for rank, o in enumerate(outs):
        assert torch.equal(o["tokens"], greedy(TinyLM().eval(), _prompt(rank), STEPS)), (rank, budget)
    info = outs[0]["info"]
    if budget is None:  # the whole model kept: the decode loop sends nothing between ranks
        assert all(o["sent"] == 0 for o in outs), [o["sent"] for o in outs]
        assert info["gathers"] == 0 and info["gathered_per_forward"] == 0
    elif budget == 3_000:  # some units kept (fp32: 750 elements), the rest gathered per forward
        assert 0 < info["kept_modules"] and 0 < info["gathered_per_forward"]
        assert info["kept_bytes"] <= 3_000
        assert 0 < info["gathers"] <= STEPS * info["gathered_per_forward"]
        assert all(o["sent"] > 0 for o in outs)
    else:
        assert all(o["sent"] > 0 for o in outs)
    assert all(o["live_after"] == 0 for o in outs)  # leaving freed what it kept


def _train_with_a_generation_between(rank: int, world: int, generate: bool) -> dict:
    model = TinyLM()
    engine = _engine(model)
    losses = []
    for i in range(4):
        ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(i * world + rank))
        loss = nn.functional.cross_entropy(engine(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if generate and i == 1:
            engine.eval()
            with torch.no_grad(), engine.generation():
                greedy(engine, _prompt(rank), 3)
            engine.train()
    return {"losses": losses, "weights": engine.full_state_dict()}


def test_training_after_a_generation_is_as_without_it():
    with_, without = (launch.run_threads(_train_with_a_generation_between, 2, args=(g,)) for g in (True, False))
    for a, b in zip(with_, without):
        assert a["losses"] == b["losses"]
        assert all(torch.equal(a["weights"][k], v) for k, v in b["weights"].items())


def _errors(rank: int, world: int) -> dict:
    model = TinyLM()
    engine = _engine(model)
    said = {}
    for name, budget in (("small", 64), ("float", 1e9), ("negative", -1)):
        try:
            with engine.generation(budget_bytes=budget):
                pass
        except ValueError as e:
            said[name] = str(e)
    with engine.generation():
        try:
            with engine.generation():
                pass
        except RuntimeError as e:
            said["nested"] = str(e)
    x = engine(torch.zeros(1, 3, dtype=torch.long)).sum()

    def hook(grad):
        try:
            with engine.generation():
                pass
        except RuntimeError as e:
            said["backward"] = str(e)
        return grad
    x.register_hook(hook)
    engine.backward(x)
    return said


def test_bad_use_is_refused_in_the_users_words():
    said = launch.run_threads(_errors, 2)[0]
    assert "budget_bytes=64) keeps no layer whole: the smallest" in said["small"] and "or None" in said["small"]
    assert "an int of bytes >= 0" in said["float"] and "an int of bytes >= 0" in said["negative"]
    assert "already open" in said["nested"]
    assert "inside a backward" in said["backward"]


LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=97, max_position_embeddings=64)


def _llama(rank: int, world: int, budget) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    engine = fz3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            fz3.Config(param_persistence_threshold=0))
    engine.eval()
    ids = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(rank))
    with torch.no_grad(), engine.generation(budget_bytes=budget):
        before = _sent()
        out = engine.module.generate(ids, max_new_tokens=8, do_sample=False)
        sent = _sent() - before
    return {"tokens": out, "sent": sent}


@pytest.mark.parametrize("budget", [None, 40_000])
def test_hf_generate_under_fz3_gives_the_unsharded_tokens(budget):
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM
    outs = launch.run_threads(_llama, 2, args=(budget,))
    torch.manual_seed(0)
    ref = LlamaForCausalLM(LlamaConfig(**LLAMA)).eval()
    for rank, o in enumerate(outs):
        ids = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(rank))
        with torch.no_grad():
            want = ref.generate(ids, max_new_tokens=8, do_sample=False)
        assert torch.equal(o["tokens"], want), (rank, o["tokens"], want)
    if budget is None:
        assert all(o["sent"] == 0 for o in outs), [o["sent"] for o in outs]
