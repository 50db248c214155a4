"""05: plan a run before it runs. fz3.plan drives the real engine and core on a fake copy of the
model (fake tensors: shapes, no memory), as one rank of any world size, and counts what every
rank will do, on this machine, without a process group.

    python examples/05_plan.py
    python -m fz3 plan examples/05_plan.py:small_gpt --world-size 64      # step 1, as a command
    python -m fz3 plan examples/05_plan.py:tiny_llama --world-size 64     # step 2 (transformers)

1. The small benchmark GPT (bench/systems/common.py "small", 4.2 M params) on 64 ranks. Step 1
   records the module order (every gather on demand); from step 2 the gathers are prefetched
   along it. The figures equal engine.stats() of a real run with the same model and config
   (tests/test_plan.py checks it on 1-3 gloo ranks).
2. A Hugging Face Llama as it comes: default attention (sdpa), a padded batch with its
   attention_mask (needs the `hf` extra; skipped without it). Its mask code reads the data;
   under fake tensors it takes its general path, and nothing needs a guess: the table says so
   by saying nothing more.
"""
import torch

import fz3
from gpt import GPT, GPTConfig, markov_batch


def small_gpt():
    """(model, example_inputs): the small benchmark GPT and one micro-batch of 8 sequences."""
    cfg = GPTConfig(vocab=4096, d_model=256, n_head=4, n_layer=4, seq=128)
    torch.manual_seed(0)
    x, y = markov_batch(0, batch=8, seq=cfg.seq, vocab=cfg.vocab)
    return GPT(cfg), (x, y)  # y: a target GPT.forward does not take; the plan leaves it out


def tiny_llama():
    """(model, example_inputs): a 2-layer LlamaForCausalLM with its default (sdpa) attention and a
    batch whose second sequence is left-padded; the loss comes from `labels`."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, 16))  # (B, T)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # (B, T): 4 pad tokens before the second sequence
    return LlamaForCausalLM(cfg), {"input_ids": ids, "attention_mask": mask, "labels": ids}


if __name__ == "__main__":
    model, inputs = small_gpt()
    print("1. the small GPT")
    print(fz3.plan(model, fz3.Config(), world_size=64, example_inputs=inputs, steps=2))
    try:
        model, inputs = tiny_llama()
    except ImportError:
        print("2. skipped: transformers is not installed (pip install 'fz3[hf]')")
    else:
        print(f"\n2. LlamaForCausalLM, attn_implementation={model.config._attn_implementation!r}, a padded mask")
        p = fz3.plan(model, fz3.Config(), world_size=64, example_inputs=inputs, steps=2)
        print(p)
        print(f"guesses: {len(p.guesses)}")
