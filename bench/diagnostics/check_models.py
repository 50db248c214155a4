"""Models for `python -m fz3 check`'s timings in bench/RESULTS.md ("python -m fz3 check"): each
function is a build() for fz3.check, returning (model, example_batches, loss_fn).

    python -m fz3 check bench/diagnostics/check_models.py:gpt_1m      # ~1M params, the default run
    python -m fz3 check bench/diagnostics/check_models.py:small_gpt   # the benchmark GPT ("small", 4.2M)
    python -m fz3 check bench/diagnostics/check_models.py:tiny_llama  # transformers, built from a config

Every batch has 6 sequences: 6 divides among 1, 2 and 3 ranks, the default world sizes.
"""
from __future__ import annotations

import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))
from gpt import GPT, GPTConfig, loss_fn, markov_batch  # noqa: E402 - examples/gpt.py

ROWS = 6  # sequences per global micro-batch


def _gpt(cfg: GPTConfig, batches: int = 4):
    torch.manual_seed(0)
    data = [markov_batch(i, batch=ROWS, seq=cfg.seq, vocab=cfg.vocab) for i in range(batches)]
    return GPT(cfg), data, lambda model, batch: loss_fn(model(batch[0]), batch[1])


def gpt_1m():
    """A 4-layer GPT of 0.93M params, sequences of 64 tokens."""
    return _gpt(GPTConfig(vocab=1024, d_model=128, n_head=4, n_layer=4, seq=64))


def small_gpt():
    """The small benchmark GPT (bench/systems/common.py "small", 4.2M params), sequences of 128."""
    return _gpt(GPTConfig(vocab=4096, d_model=256, n_head=4, n_layer=4, seq=128))


def tiny_llama():
    """A 2-layer LlamaForCausalLM from a config (no download), its default attention; the loss
    is the model's own (labels)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    data = []
    for _ in range(4):
        ids = torch.randint(0, cfg.vocab_size, (ROWS, 32), generator=g)
        data.append({"input_ids": ids, "labels": ids})
    return model, data, lambda m, batch: m(**batch).loss
