"""DeepSpeed's stage3_module_granularity_threshold (Config.module_granularity_threshold): the
modules it makes leaves, against real DeepSpeed 0.19.8's choices on three models at thresholds
around every granularity they have (tests/data/deepspeed_granularity_0.19.8.json, written by
bench/deepspeed_records/deepspeed_granularity.py), and training with those leaves, the whole
model one unit included, bit for bit as without them ([Note: leaf modules by granularity],
fz3/core/granularity.py; the rule's properties: property_tests/test_granularity_properties.py)."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import sys

import pytest
import torch

import fz3
from fz3 import launch
from fz3.core import granularity
from fz3.shell import tables
from tests.support.granularity_models import MODELS
from tests.support.same_run import assert_same_run

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
RECORD = json.load(open(os.path.join(HERE, "data", "deepspeed_granularity_0.19.8.json")))


@pytest.mark.parametrize("name", sorted(RECORD["models"]))
def test_the_leaves_are_deepspeeds(name):
    if name == "llama_tiny":
        pytest.importorskip("transformers")
    model, record = MODELS[name](), RECORD["models"][name]
    tree, modules = tables.granular(model)
    first = {id(m): n for n, m in model.named_modules()}
    got, _ = granularity.granularities(tree)
    assert {first[id(m)]: g for m, g in zip(modules, got)} == record["granularity"]
    for want in record["choices"]:
        # DeepSpeed lists a leaf once per path that reaches it (the shared Pair of `odd` twice);
        # it marks the module object, once: fz3 lists each leaf once, where first reached
        leaves_once = list(dict.fromkeys(want["leaves"]))
        choice = granularity.leaves(tree, want["threshold"])
        assert [first[id(modules[i])] for i in choice.leaves] == leaves_once, want["threshold"]
        assert (choice.smallest, choice.smallest_class) == (want["smallest"], want["smallest_class"])
        leaves = tables.granular_leaves(model, want["threshold"])
        assert [first[id(m)] for m in leaves] == leaves_once


def test_a_threshold_below_every_granularity_is_said(caplog):
    with caplog.at_level(logging.WARNING, logger="fz3"):
        assert tables.granular_leaves(MODELS["odd"](), 11) == []
    assert "smallest module granularity is Pair's, 12" in caplog.text and "set it >= 12" in caplog.text


def _train(rank: int, world: int, config: fz3.Config, init: bool = False) -> dict:
    from gpt import GPT, GPTConfig, loss_fn, markov_batch
    torch.manual_seed(0)
    with fz3.Init() if init else contextlib.nullcontext():  # built sharded: the params show full shapes
        model = GPT(GPTConfig(vocab=256, d_model=16, n_head=2, n_layer=3, seq=8))
    engine = fz3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config)
    losses = []
    for step in range(3):
        x, y = markov_batch(step, batch=4, seq=8, vocab=256)
        loss = loss_fn(engine(x[rank * 2:(rank + 1) * 2]), y[rank * 2:(rank + 1) * 2])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "weights": engine.full_state_dict(), "optimizer": engine.full_optimizer_state_dict(),
            "units": len(engine.spec.modules)}


@pytest.mark.parametrize("threshold,units,init", [(0, 27, False), (468, 9, False), (699, 1, False), (468, 9, True)],
                         ids=["off", "blocks", "whole", "blocks, built under fz3.Init"])
def test_leaves_by_granularity_train_as_without(threshold, units, init):
    """This GPT's blocks have granularity 468 and the root 699 (off: 27 fetch units, one per
    module; from 468 each block is one; from 699 the whole model is one, gathered at the root's
    call, as DeepSpeed's walk chooses the root first)."""
    base = fz3.Config(param_persistence_threshold=0, gradient_clipping=1.0)
    plain = launch.run_threads(_train, 2, args=(base,))
    config = base.replace(module_granularity_threshold=threshold)
    # fz3.Init needs a process group: gloo processes, which train as thread ranks do, bit for bit
    got = launch.run(_train, world_size=2, args=(config, True), timeout=120) if init else \
        launch.run_threads(_train, 2, args=(config,))
    for a, b in zip(plain, got):
        assert_same_run(a, b)
    assert got[0]["units"] == units
