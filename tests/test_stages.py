"""ZeRO stages 0-3 as policies of one lifecycle (fz3/core/stage.py): what each keeps whole, where
its grads wait, that a checkpoint of any stage loads at any stage and world size, and the
DeepSpeed names that say which stage runs. Numbers against DeepSpeed's own stages are
tests/test_deepspeed_stages.py's; bit-for-bit equality of the stages on exact data is
property_tests/test_engine_exact.py's (it draws the stage)."""
from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

import fz3
from fz3 import launch
from fz3.core import stage as stages
from fz3.core.stage import STAGES, Policy

pytestmark = pytest.mark.timeout(300)

D, ROWS = 6, 2


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, 12), nn.ReLU(), nn.Linear(12, 1))


def _loss(engine, rank: int, i: int) -> torch.Tensor:
    x = torch.randn(ROWS, D, generator=torch.Generator().manual_seed(100 * i + rank))
    return engine(x).square().mean()


def test_the_three_policies_make_the_four_stages():
    assert STAGES == {0: Policy(True, True, True), 1: Policy(True, True, False), 2: Policy(True, False, False),
                      3: Policy(False, False, False)}
    big = fz3.Config(param_persistence_threshold=7, model_persistence_threshold=100)
    assert stages.persistence(big) == (7, 100)
    assert [stages.persistence(big.replace(stage=s)) == (sys.maxsize, None) for s in range(4)] == [True] * 3 + [False]
    assert [stages.layout_world(big.replace(stage=s), 4) for s in range(4)] == [1, 4, 4, 4]


def _measure(rank: int, world: int, stage: int) -> dict:
    model = _net()
    engine = fz3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                            fz3.Config(stage=stage, gradient_accumulation_steps=2, param_persistence_threshold=0))
    n = sum(shape.numel() for shape in engine.store.shapes)
    engine.backward(_loss(engine, rank, 0))
    mid = {"whole grads": sum(p.grad.numel() for p in engine.tables.params if p.grad is not None) / n,
           "partitions": engine.stats()["grad_partitions"] / 4 / n,
           "live": engine.stats()["live_numel"] / n}
    engine.step()
    engine.backward(_loss(engine, rank, 1))
    engine.step()
    return {"mid": mid, "masters": sum(m.numel() for m in engine.store.masters) / n,
            "states": engine.stats()["optimizer_state_bytes"] / 4 / n, "names": (
                engine.zero_optimization(), engine.zero_optimization_stage(),
                engine.zero_optimization_partition_gradients(), engine.zero_optimization_partition_weights()),
            "live after step": engine.stats()["live_numel"] / n}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_each_stage_keeps_what_its_policy_says(stage):
    """Elements per param per rank (2 ranks): masters and AdamW's two moments whole at stage 0,
    halved above; after a backward, grads whole in .grad at stages 0 and 1, in partitions at 2
    and 3; params live (whole) at stages 0-2, freed at 3. DeepSpeed's stage names answer."""
    for out in launch.run_threads(_measure, 2, args=(stage,)):
        whole = stage == 0
        assert out["masters"] == pytest.approx(1.0 if whole else 0.5, abs=0.05), out
        assert out["states"] == pytest.approx(2.0 if whole else 1.0, abs=0.1), out  # exp_avg, exp_avg_sq (+ step)
        mid = out["mid"]
        assert (mid["whole grads"], mid["partitions"] > 0) == ((1.0, False) if stage < 2 else (0.0, True)), mid
        assert (mid["live"], out["live after step"]) == ((1.0, 1.0) if stage < 3 else (0.0, 0.0)), out
        assert out["names"] == (stage > 0, stage, stage >= 2, stage == 3)


def _kept_shards(rank: int, world: int, stage: int) -> dict:
    model = _net()
    engine = fz3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                            fz3.Config(stage=stage, compute_dtype="bf16", param_persistence_threshold=0))
    for i in range(2):
        engine.backward(_loss(engine, rank, i))
        engine.step()
    store = engine.store
    n = [s.numel() for s in store.shards]
    return {"in full": [store.full_of(s) is not None for s in store.shards],
            "current": all(torch.equal(s, m.detach().bfloat16()) for s, m in zip(store.shards, store.masters)),
            "slice": all(torch.equal(f[rank * k:(rank + 1) * k], s)
                         for f, s, k in zip(store.full, store.shards, n) if store.full_of(s) is not None),
            "param_shards": engine.stats()["param_shards"], "masters": 4 * sum(n),
            "apart": sum(2 * k for k, f, full in zip(n, store.shards, store.full) if store.full_of(f) is None)}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_kept_param_holds_its_bf16_shard_in_its_full_value(stage):
    """[Note: a kept param holds its shard] (fz3/data/store.py): at stages 1 and 2 every param is
    kept whole, and a param split without padding (2 ranks: all but the last bias, of 1 element)
    reads its bf16 shard from its full value, not from a second copy; at stage 3 (nothing kept
    here) every shard lies apart. The shards stay the masters' bf16 values through the steps,
    and param_shards counts the bytes held once."""
    for out in launch.run_threads(_kept_shards, 2, args=(stage,)):
        assert out["in full"] == ([True, True, True, False] if stage < 3 else [False] * 4), out
        assert out["current"] and out["slice"], out
        assert out["param_shards"] == out["masters"] + out["apart"], out


def _no_sync(rank: int, world: int, stage: int) -> str:
    model = _net()
    engine = fz3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), fz3.Config(stage=stage))
    try:
        with engine.no_sync():
            engine.backward(_loss(engine, rank, 0))
            engine.backward(_loss(engine, rank, 1))
    except AssertionError as e:
        return str(e)
    engine.step()
    return "stepped" if engine.was_step_applied() else "not stepped"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_no_sync_where_grads_wait_anyway(stage):
    """DeepSpeed allows no_sync where grads are not partitioned (stages 0, 1) and refuses it,
    naming the stage, where they are."""
    out = launch.run_threads(_no_sync, 2, args=(stage,))[0]
    if stage < 2:
        assert out == "stepped"
    else:
        assert out == f"no_sync context manager is incompatible with gradient partitioning logic of ZeRO stage {stage}"


def _save(rank: int, world: int, stage: int, path: str) -> dict:
    model = _net()
    engine = fz3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), fz3.Config(stage=stage))
    for i in range(2):
        engine.backward(_loss(engine, rank, i))
        engine.step()
    engine.save_checkpoint(path, tag="t")
    return {"weights": engine.full_state_dict(), "optimizer": engine.full_optimizer_state_dict()}


def _load(rank: int, world: int, stage: int, path: str) -> dict:
    model = _net()
    engine = fz3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), fz3.Config(stage=stage))
    engine.load_checkpoint(path, tag="t")
    return {"weights": engine.full_state_dict(), "optimizer": engine.full_optimizer_state_dict(),
            "steps": engine.global_steps}


@pytest.mark.parametrize("saved, loaded", [((3, 2), (0, 3)), ((0, 2), (3, 3)), ((1, 2), (2, 1)), ((2, 3), (1, 2)),
                                           ((0, 3), (0, 2))])
def test_a_checkpoint_of_any_stage_loads_at_any_stage_and_world_size(tmp_path, saved, loaded):
    """(stage, ranks) saved -> (stage, ranks) loaded: every weight and every optimizer state
    tensor whole, as saved."""
    path = str(tmp_path / "ckpt")
    before = launch.run_threads(_save, saved[1], args=(saved[0], path))[0]
    for out in launch.run_threads(_load, loaded[1], args=(loaded[0], path)):
        assert out["steps"] == 2
        for k, v in before["weights"].items():
            assert torch.equal(out["weights"][k], v), k
        for i, entry in before["optimizer"]["state"].items():
            for k, v in entry.items():
                assert torch.equal(torch.as_tensor(out["optimizer"]["state"][i][k]), torch.as_tensor(v)), (i, k)


def test_the_stage_and_its_keys_from_deepspeeds_json():
    ds = {"zero_optimization": {"stage": 2, "allgather_partitions": True, "allgather_bucket_size": 5e8,
                                "round_robin_gradients": True, "reduce_scatter": True}}
    with pytest.warns(UserWarning, match="allgather_partitions"):
        cfg = fz3.Config.from_deepspeed(ds)
    assert (cfg.stage, cfg.overlap_comm) == (2, False)  # DeepSpeed's overlap_comm: True at stage 3 only
    assert fz3.Config.from_deepspeed({"zero_optimization": {"stage": 3}}).overlap_comm
    with pytest.warns(UserWarning, match="train_batch_size"):
        assert fz3.Config.from_deepspeed({"train_batch_size": 8, "gradient_accumulation_steps": 1}).stage == 0
    assert fz3.Config.from_deepspeed({"zero_optimization": {"stage": "auto"}}).stage == 0  # DeepSpeed's default
    for bad in (4, -1, "3", True):
        with pytest.raises(ValueError, match=rf"zero_optimization.stage = {bad!r}: DeepSpeed's stages are 0, 1, 2 "
                                             r"and 3 \(DeepSpeed 0.19.8: 'Input should be 0, 1, 2, 3'\)"):
            fz3.Config.from_deepspeed({"zero_optimization": {"stage": bad}})
    with pytest.raises(ValueError, match=r"managed_gradient_accumulation false with zero_optimization.overlap_comm "
                                         r"true at stage 1: DeepSpeed 0.19.8 refuses it"):
        fz3.Config.from_deepspeed({"managed_gradient_accumulation": False,
                                   "zero_optimization": {"stage": 1, "overlap_comm": True}})
    with pytest.raises(ValueError, match="MiCS ZeRO-3 sharding has been removed"):
        fz3.Config.from_deepspeed({"zero_optimization": {"stage": 3, "mics_shard_size": 2}})


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_plan_reports_every_stage(stage):
    """fz3.plan at 4 ranks: the stage in the table's first line; masters and AdamW's state whole
    at stage 0 and a quarter above; the grads waiting whole at stages 0 and 1."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    n = sum(p.numel() for p in model.parameters())
    p = fz3.plan(model, fz3.Config(stage=stage, param_persistence_threshold=0), world_size=4,
                 example_inputs=(torch.randn(2, 64),))
    assert p.table().startswith(f"fz3 plan: ZeRO stage {stage} (")
    share = 1 if stage == 0 else 4
    assert p.stats["param_shards"] == pytest.approx(4 * n / share, rel=0.05)
    assert p.steps[0]["optimizer_state_bytes"] == pytest.approx(8 * n / share, rel=0.05)
    assert p.steps[0]["waiting_grad_bytes"] == (4 * n if stage < 2 else 0)
