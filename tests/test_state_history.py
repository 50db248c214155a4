"""What a run keeps: no history of the core state, and nothing once the user lets go.

The core's state is persistent (fz3/core/pvec.py): an old version of a PVec reaches the diffs of
every later version, so anything that keeps one old state alive keeps every change made since,
and the heap grows by each step's changes for as long as it lives. The engine once kept its
first state for engine.compile()'s "has anything run yet?" check: ~0.5 MiB a step per rank on
the deep narrow GPT, without bound. Here the core's persistent vectors are counted after a few
steps and again many steps later, on thread ranks and on a model whose params are all gathered
and freed (every step changes every row): the count must not grow.
"""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from fz3.core.pvec import PVec
from fz3.interpreters.threads import run_threads

pytestmark = pytest.mark.timeout(120)


def _live_pvecs() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is PVec)


def _train(rank: int, world: int, gas: int) -> list[int]:
    import fz3
    from gpt import GPT, GPTConfig, loss_fn, markov_batch
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=32, d_model=8, n_head=2, n_layer=2, seq=8))
    engine = fz3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                            fz3.Config(param_persistence_threshold=0, gradient_accumulation_steps=gas))
    counts = []
    for i in range(60):
        x, y = markov_batch(i, batch=4, seq=8, vocab=32)
        engine.backward(loss_fn(engine(x), y))
        engine.step()
        if i % 10 == 9:
            with torch.no_grad():
                engine(x)  # an eval pass too: its own trace kind, and its own schedules
            if rank == 0 and i in (29, 59):
                counts.append(_live_pvecs())
    return counts


@pytest.mark.parametrize("gas", [1, 2])
def test_the_heap_does_not_grow_with_the_steps(gas):
    """The schedules the replay keeps (fz3/core/replay.py) hold the states of their passes, a
    bounded number of them: by step 30 they are all there, and 30 steps later nothing more is."""
    counts = run_threads(_train, 2, args=(gas,))[0]
    # a kept state would have added thousands of versions by then
    assert counts[1] <= counts[0] + 8, counts


def _made(rank: int, world: int) -> tuple:
    import fz3
    from gpt import GPT, GPTConfig, loss_fn, markov_batch
    model = GPT(GPTConfig(vocab=32, d_model=8, n_head=2, n_layer=2, seq=8))
    engine = fz3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), fz3.Config())
    x, y = markov_batch(0, batch=4, seq=8, vocab=32)
    engine.backward(loss_fn(engine(x), y))
    engine.step()
    return weakref.ref(engine), weakref.ref(model)


def test_an_engine_and_its_model_are_freed_once_let_go():
    """The grad hooks sit on the params, inside torch's tensors, where the garbage collector
    does not look: a hook holding the engine kept every engine, and so its model and shards,
    alive for the life of the process (a notebook, a test run, a Trainer building several)."""
    refs = run_threads(_made, 2)
    gc.collect()
    assert all(r() is None for pair in refs for r in pair), [[r() is not None for r in pair] for pair in refs]
