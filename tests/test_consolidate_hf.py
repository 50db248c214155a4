"""A consolidated checkpoint of a Hugging Face model loads with `from_pretrained` (issue #11).

Two gloo ranks train a tiny GPT-2 (tied wte / lm_head) and a tiny Llama (untied) one step with
fz3, save a sharded checkpoint, and `python -m fz3.consolidate` turns it into
`model.safetensors` beside the model's `config.json`: `from_pretrained(folder)` gives the
trained weights exactly (tied weights stored once, as Hugging Face stores them).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from fz3 import launch

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)

VOCAB, SEQ = 64, 12


def _build(name: str):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(3)
    if name == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2,
                                          n_head=4, use_cache=False))
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, use_cache=False,
                                        tie_word_embeddings=False))


def _train_and_save(rank: int, world_size: int, root: str) -> dict:
    import fz3
    out = {}
    for name in ("gpt2", "llama"):
        model = _build(name)
        model.config.save_pretrained(os.path.join(root, name))  # config.json, for from_pretrained
        engine = fz3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                fz3.Config(param_persistence_threshold=0))
        x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(rank))
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
        engine.save_checkpoint(os.path.join(root, name + "-ckpt"))
        out[name] = {k: v.clone() for k, v in engine.full_state_dict().items()}
    return out


def test_consolidated_checkpoint_loads_with_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM
    trained = launch.run(_train_and_save, world_size=2, args=(str(tmp_path),), timeout=240)[0]
    for name in ("gpt2", "llama"):
        folder = tmp_path / name
        done = subprocess.run([sys.executable, "-m", "fz3.consolidate", str(tmp_path / (name + "-ckpt")),
                               str(folder / "model.safetensors")], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        model = AutoModelForCausalLM.from_pretrained(folder)
        state = model.state_dict()
        assert set(state) == set(trained[name]), set(state) ^ set(trained[name])
        for key, want in trained[name].items():
            assert torch.equal(state[key], want), f"{name}: {key} differs after from_pretrained"
        if name == "gpt2":  # the tie survives: one Parameter under both names
            assert model.lm_head.weight is model.transformer.wte.weight
