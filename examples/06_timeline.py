"""06: see what a run did. Two steps of the small GPT on 2 local CPU ranks inside fz3.timeline:
one Chrome trace-event file with a process per rank and lanes for compute (each module's forward
and backward), communication (each all-gather and reduce, issue to wait) and the core (each
transition), plus each rank's live bytes.

    python examples/06_timeline.py [run.json]            # writes run.json (default /tmp/fz3_run.json)
    python -m fz3 timeline run.json run.png               # draws it; or open run.json in
                                                          # https://ui.perfetto.dev or chrome://tracing

The first step records the module order and gathers on demand; the two recorded steps prefetch
along it, so their communication lane shows few, large gathers.
"""
import sys

import torch

import fz3
from fz3 import launch


def train(rank: int, world: int, path: str) -> None:
    from gpt import GPT, GPTConfig, loss_fn, markov_batch
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=4096, d_model=256, n_head=4, n_layer=4, seq=128))
    engine = fz3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), fz3.Config())
    batches = [markov_batch(s, batch=8, seq=128, vocab=4096) for s in range(3)]
    mine = slice(4 * rank, 4 * rank + 4)

    def step(x, y) -> None:
        engine.backward(loss_fn(engine(x[mine]), y[mine]))
        engine.step()

    step(*batches[0])  # records the module order
    with fz3.timeline(engine, path):  # every rank enters; rank 0 writes the file
        for x, y in batches[1:]:
            step(x, y)

if __name__ == "__main__":
    path = sys.argv[1] if len(sys.argv) > 1 else "/tmp/fz3_run.json"
    launch.run(train, world_size=2, args=(path,), timeout=300)
    print(f"wrote {path}: python -m fz3 timeline {path} run.png, or open it in https://ui.perfetto.dev")
