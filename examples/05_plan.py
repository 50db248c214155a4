"""05: plan a run before it runs. fz3.plan drives the real engine and core on a meta copy of the
model, as one rank of any world size, and counts what every rank will do: here the small
benchmark GPT (bench/systems/common.py "small", 4.2 M params) on 64 ranks, on this machine,
without a process group.

    python examples/05_plan.py
    python -m fz3 plan examples/05_plan.py:small_gpt --world-size 64      # the same, as a command

Step 1 records the module order (every gather on demand); from step 2 the gathers are prefetched
along it. The figures equal engine.stats() of a real run with the same model and config
(tests/test_plan.py checks it on 1-3 gloo ranks).
"""
import torch

import fz3
from fz3.testing.gpt import GPT, GPTConfig, markov_batch


def small_gpt():
    """(model, example_inputs): the small benchmark GPT and one micro-batch of 8 sequences."""
    cfg = GPTConfig(vocab=4096, d_model=256, n_head=4, n_layer=4, seq=128)
    torch.manual_seed(0)
    x, y = markov_batch(0, batch=8, seq=cfg.seq, vocab=cfg.vocab)
    return GPT(cfg), (x, y)  # y: a target GPT.forward does not take; the plan leaves it out


if __name__ == "__main__":
    model, inputs = small_gpt()
    print(fz3.plan(model, fz3.Config(), world_size=64, example_inputs=inputs, steps=2))
