"""The models whose stage3_module_granularity_threshold leaves real DeepSpeed 0.19.8 chose
(bench/deepspeed_records/deepspeed_granularity.py, tests/data/deepspeed_granularity_0.19.8.json)
and fz3 must choose alike (tests/test_granularity.py). Built here once, for both."""
from __future__ import annotations

import torch
from torch import nn


class Pair(nn.Module):
    """Two Linears and a param-less activation between them."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.a, self.act, self.b = nn.Linear(d, d), nn.GELU(), nn.Linear(d, d, bias=False)

    def forward(self, x):
        return self.b(self.act(self.a(x)))


class Odd(nn.Module):
    """DeepSpeed's corner cases in one tree: a Sequential and a ModuleList (containers: never
    leaves), param-less modules (GELU, Dropout, an empty Sequential), a submodule shared by two
    parents, an empty param, a module with params of its own and children, and a wide Linear
    whose granularity is far above the rest."""

    def __init__(self) -> None:
        super().__init__()
        shared = Pair(4)
        self.stem = nn.Sequential(nn.Linear(8, 4), nn.Dropout(0.0), Pair(4))
        self.blocks = nn.ModuleList([Pair(4), Pair(4), nn.Sequential(shared, nn.GELU())])
        self.again = nn.Sequential(shared)  # the same Pair under a second parent
        self.scale = nn.Parameter(torch.ones(4))  # the root's own param
        self.empty = nn.Parameter(torch.empty(0))
        self.nothing = nn.Sequential()
        self.wide = nn.Linear(4, 512)

    def forward(self, x):
        h = self.stem(x)
        for b in self.blocks:
            h = b(h)
        return self.wide(self.again(h) * self.scale)


def gpt_deep() -> nn.Module:
    from gpt import GPT, GPTConfig  # examples/gpt.py
    return GPT(GPTConfig(vocab=128, d_model=32, n_head=2, n_layer=16, seq=8))


def llama_tiny() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


MODELS = {"gpt_deep": gpt_deep, "llama_tiny": llama_tiny, "odd": Odd}
