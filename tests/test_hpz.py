"""hpZ (issue #49, point 2): DeepSpeed's zero_hpz_partition_size H. A forward's release keeps a
secondary shard of each param its backward gathers again, over groups of H consecutive ranks,
and the backward gathers from those within the group ([Note: hpZ], fz3/core/stage.py).

    parity     6 thread ranks with groups of 2 against one process (tests/support/parity.py's
               GPT: gradient accumulation, tied weights, a scheduler, forward-only passes between
               steps); groups of 3 in bf16 with clipping are parity.HYBRID_CONFIGS["hpz3_bf16_clip"]
    on = off   the secondary shards are copies of the full values, so a layout trains bit for
               bit alike with hpZ on and off: 4 gloo processes, flat, groups of 2 (the process
               groups); 8 thread ranks as 2 shard groups of 4 with groups of 2, and flat with
               groups of 4; each with gradient accumulation, clipping, and weights rewritten by
               gathered_parameters between two micro-steps (a secondary shard kept past it
               would be stale)
    the links  on thread ranks, every message of a gather of secondary shards stays in its group
    the plan   bytes and messages on each link, the gathers of secondary shards and their peak
               memory equal fz3.plan's; flat across 2 nodes of 2, hpZ takes the backward's
               gathers off the inter-node link
    errors     a group larger than the shard group, one that does not divide it, stage < 3; the
               DeepSpeed key
The checkpoints across layouts with hpZ on and off: tests/test_hybrid_sharding.py.
"""
from __future__ import annotations

import functools
import warnings
from collections import Counter

import pytest
import torch
from torch import nn

import fz3
from fz3 import launch
from tests.support import parity

pytestmark = pytest.mark.timeout(600)

CONFIGS = ("hpz",)  # bf16 with clipping: hpz3_bf16_clip in tests/support/parity.py, run by hand (the suite's
# time); hpZ on equals hpZ off bit for bit below, in fp32 with clipping, and off is at parity everywhere
MODELS = ("gpt",)
W = 6


@functools.lru_cache(maxsize=None)
def _six_ranks() -> dict:
    return parity.run_world(W, MODELS, probes=False, timeout=500, threads=True, configs=CONFIGS)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("cname", CONFIGS)
def test_six_ranks_with_secondary_shards_train_as_one_process(model, cname):
    res = _six_ranks()
    where = f"{model} / {cname} / hpZ groups of {parity.config_named(cname).zero_hpz_partition_size}"
    parity.assert_config_trains(res, model, cname, W, where)
    assert res[model, cname].stats["all_gather_hpz"] > 0, where  # the backward gathered secondary shards


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 9), nn.Tanh(), nn.Linear(9, 9), nn.Tanh(), nn.Linear(9, 2))


def _on_and_off(rank: int, world: int, layouts: tuple) -> dict:
    """For each (S, H) of `layouts`: 3 windows of 2 micro-steps, AdamW with clipping, a live budget
    that makes every forward free what its backward gathers again (whole-model prefetch would
    keep it), and a weight halved by gathered_parameters after the first micro-step of the
    second window; -> the
    losses, the consolidated weights, the gathers of secondary shards and their peak bytes."""
    out = {}
    for S, H in layouts:
        model = _net()
        engine = fz3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                fz3.Config(param_persistence_threshold=0, shard_group_size=S, zero_hpz_partition_size=H,
                                           gradient_accumulation_steps=2, gradient_clipping=0.1,
                                           max_live_parameters=0))  # the forward frees: secondaries every pass
        g = torch.Generator().manual_seed(2)
        losses, hpz = [], 0
        for i in range(6):
            x = torch.randn(world * 3, 5, generator=g)
            loss = engine(x[rank * 3:(rank + 1) * 3]).sin().sum()
            engine.backward(loss)
            hpz += engine.stats()["all_gather_hpz"]
            engine.step()
            losses.append(loss.item())
            if i == 2:  # within a window: the next forward must keep fresh secondary shards
                with fz3.gathered_parameters([model[2].weight], modifier_rank=0):
                    model[2].weight.data.mul_(0.5)
        stats = engine.stats()
        out[S, H] = (losses, engine.full_state_dict(), hpz, stats["peak_secondary_param_bytes"],
                     stats["secondary_param_bytes"])
    return out


def _assert_on_equals_off(outs: list, on: tuple, off: tuple) -> None:
    for rank, o in enumerate(outs):
        assert o[on][0] == o[off][0], (rank, on, o[on][0], o[off][0])  # bit for bit
        for k, v in o[off][1].items():
            assert torch.equal(o[on][1][k], v), (rank, on, k)
        assert o[on][2] > 0 and o[off][2] == 0, (rank, on, o[on][2], o[off][2])
        assert o[on][3] > 0 and o[off][3] == 0, (rank, on, o[on][3], o[off][3])
        assert o[on][4] == 0  # none left after the step


def test_four_gloo_ranks_train_alike_with_hpz_on_and_off():
    outs = launch.run(_on_and_off, world_size=4, args=(((0, 2), (0, 1)),), timeout=300)
    _assert_on_equals_off(outs, (0, 2), (0, 1))


def test_eight_thread_ranks_hybrid_and_flat_train_alike_with_hpz_on_and_off():
    outs = launch.run_threads(_on_and_off, 8, args=(((4, 2), (4, 1), (0, 4), (0, 1)),))
    _assert_on_equals_off(outs, (4, 2), (4, 1))
    _assert_on_equals_off(outs, (0, 4), (0, 1))


def _links(rank: int, world: int, H: int) -> dict:
    """Two steps on thread ranks, flat with hpZ groups of H: this rank's sends, by namespace."""
    from fz3.interpreters import threads
    model = _net()
    engine = fz3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            fz3.Config(param_persistence_threshold=0, zero_hpz_partition_size=H))
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        engine.backward(engine(torch.randn(world, 5, generator=g)[rank:rank + 1]).pow(2).sum())
        engine.step()
    sent = Counter()
    for (src, dst, tag), n in threads.current().world.sends.items():
        if src == rank:
            sent[(tag[0][0] if isinstance(tag, tuple) else "world", src, dst)] += n
    return {"sent": sent, "hpz": engine.stats()["all_gather_hpz"]}


@pytest.mark.parametrize("world,H", [(4, 2), (6, 3)])
def test_the_gathers_of_secondary_shards_stay_in_their_group(world, H):
    outs = launch.run_threads(_links, world, args=(H,))
    sent = sum((o["sent"] for o in outs), Counter())
    hpz = {(src, dst) for (name, src, dst) in sent if name == "hpz"}
    assert hpz and all(src // H == dst // H for src, dst in hpz), sorted(hpz)
    assert all(o["hpz"] > 0 for o in outs)


def _gpt():
    from gpt import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=64, d_model=32, n_head=4, n_layer=2, seq=16))


KEYS = ("bytes_intra_group", "bytes_inter_group", "messages_intra_group", "messages_inter_group", "gathered_bytes",
        "all_gather", "all_gather_hpz", "reduced_bytes")


def _link_counts(rank: int, world: int, H: int) -> dict:
    from gpt import loss_fn, markov_batch
    model = _gpt()
    engine = fz3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                            fz3.Config(param_persistence_threshold=64, zero_hpz_partition_size=H))
    for i in range(2):
        x, y = markov_batch(i, batch=8, seq=16, vocab=64)
        engine.backward(loss_fn(engine(x[rank * 2:(rank + 1) * 2]), y[rank * 2:(rank + 1) * 2]))
        engine.step()
    stats = engine.stats()
    return {**{k: stats[k] for k in KEYS}, "peak_secondary_bytes": stats["peak_secondary_param_bytes"]}


def test_the_links_and_the_memory_of_hpz_are_what_the_plan_says(monkeypatch):
    """Flat on 2 nodes of 2 (LOCAL_WORLD_SIZE): with hpZ groups of 2, engine.stats()'s bytes and
    messages on each link, its gathers and the secondary shards' peak equal fz3.plan's; the
    backward's gathers leave the inter-node link, so fewer bytes cross it than without."""
    from gpt import markov_batch
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    got = {H: launch.run_threads(_link_counts, 4, args=(H,)) for H in (1, 2)}
    x, _ = markov_batch(0, batch=8, seq=16, vocab=64)
    for H in (1, 2):
        plan = fz3.plan(_gpt(), fz3.Config(param_persistence_threshold=64, zero_hpz_partition_size=H), world_size=4,
                        example_inputs=(x[:2],), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
                        steps=2, ranks_per_node=2)
        for g in got[H]:
            assert g == got[H][0]  # every rank alike
            for k in KEYS:
                assert g[k] == plan.stats[k], (H, k, g[k], plan.stats[k])
            assert g["peak_secondary_bytes"] == max(s["peak_secondary_bytes"] for s in plan.steps), (H, g)
    on, off = got[2][0], got[1][0]
    assert on["all_gather_hpz"] > 0 == off["all_gather_hpz"] and on["peak_secondary_bytes"] > 0
    # a gather of secondary shards sends each one half of the param (1/H), not a quarter, to the peer on the node
    assert on["bytes_inter_group"] < off["bytes_inter_group"] and on["bytes_intra_group"] > off["bytes_intra_group"]
    assert on["messages_inter_group"] < off["messages_inter_group"]


@pytest.mark.parametrize("fields,world,words", [
    (dict(zero_hpz_partition_size=8), 4, r"zero_hpz_partition_size=8 is larger than the shard group.*divisor of 4"),
    (dict(zero_hpz_partition_size=4, shard_group_size=2), 8,
     r"zero_hpz_partition_size=4 is larger than the shard group.*shard_group_size=2"),
    (dict(zero_hpz_partition_size=3), 4, r"zero_hpz_partition_size=3 does not divide .* one of \[1, 2, 4\]"),
])
def test_bad_hpz_groups_are_refused_in_the_users_words(fields, world, words):
    with pytest.raises(ValueError, match=words):
        fz3.plan(_net(), fz3.Config(**fields), world_size=world, example_inputs=(torch.zeros(1, 5),))


def test_hpz_below_stage_3_is_refused_and_the_deepspeed_key_is_read():
    with pytest.raises(ValueError, match=r"zero_hpz_partition_size=2 .* at stage 2 params stay whole.*use stage 3"):
        fz3.Config(stage=2, zero_hpz_partition_size=2)
    with pytest.raises(TypeError, match="zero_hpz_partition_size must be an int"):
        fz3.Config(zero_hpz_partition_size=2.0)
    cfg = fz3.Config.from_deepspeed({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}})
    assert cfg.zero_hpz_partition_size == 8
    with warnings.catch_warnings(record=True) as seen:  # DeepSpeed's stages 0-2 never read it
        warnings.simplefilter("always")
        cfg = fz3.Config.from_deepspeed({"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 8}})
    assert cfg.zero_hpz_partition_size == 1
    assert any("zero_optimization.zero_hpz_partition_size" in str(w.message) for w in seen)


def test_a_group_equal_to_the_shard_group_is_the_shard_itself():
    """H = S: a secondary shard would be the shard, so nothing is kept (and nothing is planned)."""
    p = fz3.plan(_net(), fz3.Config(param_persistence_threshold=0, zero_hpz_partition_size=4), world_size=4,
                 example_inputs=(torch.zeros(1, 5),))
    assert p.stats["all_gather_hpz"] == 0 and p.steps[0]["peak_secondary_bytes"] == 0
    p = fz3.plan(_net(), fz3.Config(param_persistence_threshold=0, zero_hpz_partition_size=2), world_size=4,
                 example_inputs=(torch.zeros(1, 5),))
    assert p.stats["all_gather_hpz"] > 0 and p.steps[0]["peak_secondary_bytes"] > 0
