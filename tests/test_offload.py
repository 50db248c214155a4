"""Optimizer offload to NVMe (issue #47): the same numbers as without it, bit for bit, with the
masters and the optimizer state on disk between steps; checkpoints across offload and world
sizes; DeepSpeed's keys and its refusals (tests/data/deepspeed_offload_0.19.8.json, recorded by
bench/deepspeed_records/deepspeed_offload.py); the disk's errors in the user's words; its files gone.

Thread ranks (fz3.launch.run_threads) on CPU; the schedule itself is proven by the machine
(fz3/testing/offload_machine.py, property_tests/test_offload_machine.py)."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from torch import nn

import fz3
from fz3 import launch
from tests.support.same_run import assert_same_run

HERE = os.path.dirname(__file__)
RECORD = os.path.join(HERE, "data", "deepspeed_offload_0.19.8.json")


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))


def _train(rank: int, world: int, config: fz3.Config, steps: int, opt: str, gas: int = 1) -> dict:
    model = _net()
    optimizer = (torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if opt == "sgd" else
                 torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1))
    engine = fz3.initialize(model, optimizer, config.replace(gradient_accumulation_steps=gas))
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(steps * gas):
        x = torch.randn(4, 8, generator=g)
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    out = {"losses": losses, "weights": engine.full_state_dict(), "optimizer": engine.full_optimizer_state_dict(),
           "stats": engine.stats(), "dirs": sorted(os.listdir(config.offload_optimizer.nvme_path))
           if config.offload_optimizer.nvme_path else []}
    return out


def _nvme(path, **options) -> dict:
    return {"device": "nvme", "nvme_path": str(path), **options}


@pytest.mark.parametrize("dtype, opt, sub_group_size, options, gas", [
    ("fp32", "adamw", 1_000_000_000, {}, 1),  # DeepSpeed's defaults: one sub-group
    ("fp32", "adamw", 300, {"pipeline_read": True, "pipeline_write": True}, 1),
    ("bf16", "adamw", 300, {"ratio": 0.5}, 2),
    ("fp32", "sgd", 500, {"pipeline_write": True}, 1),
])
def test_a_step_with_offload_equals_the_step_without(tmp_path, dtype, opt, sub_group_size, options, gas):
    """Losses, weights and every optimizer state tensor equal to the bit, with several sub-groups,
    reading ahead and writing behind, a partial ratio, bf16 and accumulation; the step read and
    wrote the disk."""
    base = fz3.Config(compute_dtype=dtype, param_persistence_threshold=0, gradient_clipping=1.0,
                      sub_group_size=sub_group_size)
    plain = launch.run_threads(_train, 2, args=(base, 3, opt, gas))
    off = launch.run_threads(_train, 2, args=(base.replace(offload_optimizer=_nvme(tmp_path, **options)), 3, opt, gas))
    for a, b in zip(plain, off):
        assert_same_run(a, b)
        s = b["stats"]
        assert s["offloaded_subgroups"] >= 1 and s["step_disk_bytes_read"] > 0 and s["step_disk_bytes_written"] > 0, s
        if sub_group_size < 1000:
            assert s["subgroups"] > 1, s
        assert len(b["dirs"]) == 2  # one folder a rank, while the engines live


def _save_ckpt(rank: int, world: int, config: fz3.Config, path: str) -> dict:
    model = _net()
    engine = fz3.initialize(model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1), config)
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        engine.backward(engine(torch.randn(4, 8, generator=g)).square().mean())
        engine.step()
    engine.save_checkpoint(path, tag="t")
    return {"weights": engine.full_state_dict(), "optimizer": engine.full_optimizer_state_dict()}


def _load_ckpt(rank: int, world: int, config: fz3.Config, path: str) -> dict:
    model = _net()
    engine = fz3.initialize(model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1), config)
    engine.load_checkpoint(path, tag="t")
    out = {"weights": engine.full_state_dict(), "optimizer": engine.full_optimizer_state_dict()}
    g = torch.Generator().manual_seed(7)
    engine.backward(engine(torch.randn(4, 8, generator=g)).square().mean())
    engine.step()
    out["after"] = engine.full_state_dict()
    return out


@pytest.mark.parametrize("saved, loaded", [((True, 2), (False, 1)), ((False, 2), (True, 3)), ((True, 3), (True, 2))])
def test_checkpoints_load_across_offload_and_world_sizes(tmp_path, saved, loaded):
    """(offload, ranks) saved -> (offload, ranks) loaded: every weight and optimizer state as
    saved, and the next step the same with offload on or off."""
    cfg = fz3.Config(param_persistence_threshold=0, sub_group_size=300)
    on = cfg.replace(offload_optimizer=_nvme(tmp_path))
    path = str(tmp_path / "ckpt")
    before = launch.run_threads(_save_ckpt, saved[1], args=(on if saved[0] else cfg, path))[0]
    got = launch.run_threads(_load_ckpt, loaded[1], args=(on if loaded[0] else cfg, path))
    twin = launch.run_threads(_load_ckpt, loaded[1], args=(cfg if loaded[0] else on, path))
    for out, other in zip(got, twin):
        for k, v in before["weights"].items():
            assert torch.equal(out["weights"][k], v), k
            assert torch.equal(out["after"][k], other["after"][k]), k
        for i, entry in before["optimizer"]["state"].items():
            for k, v in entry.items():
                assert torch.equal(torch.as_tensor(out["optimizer"]["state"][i][k]), torch.as_tensor(v)), (i, k)


def _one_engine(rank: int, world: int, config: fz3.Config) -> list[str]:
    model = _net()
    fz3.initialize(model, torch.optim.AdamW(model.parameters()), config)
    return []


def test_the_disk_is_checked_before_anything_is_written(tmp_path, monkeypatch):
    """A missing folder, one this process cannot write, and one without the space: each named,
    with the numbers."""
    missing = fz3.Config(offload_optimizer=_nvme(tmp_path / "nope"))
    with pytest.raises(RuntimeError, match=r"nvme_path = '.*nope': no such folder"):
        launch.run_threads(_one_engine, 1, args=(missing,))
    monkeypatch.setattr("fz3.data.swap.os.access", lambda path, mode: False)
    with pytest.raises(RuntimeError, match="cannot write there"):
        launch.run_threads(_one_engine, 1, args=(fz3.Config(offload_optimizer=_nvme(tmp_path)),))
    monkeypatch.undo()
    monkeypatch.setattr("fz3.data.swap.shutil.disk_usage", lambda path: shutil._ntuple_diskusage(10, 10, 1000))
    with pytest.raises(RuntimeError, match=r"0\.00 GiB free, and the offloaded state needs .*\([0-9,]+ bytes"):
        launch.run_threads(_one_engine, 1, args=(fz3.Config(offload_optimizer=_nvme(tmp_path)),))
    with pytest.raises(RuntimeError, match=r"offload_param\.nvme_path = '.*': 0\.00 GiB free"):  # params alone
        launch.run_threads(_one_engine, 1, args=(fz3.Config(compute_dtype="bf16", offload_param=_nvme(tmp_path)),))
    monkeypatch.undo()
    params_missing = fz3.Config(compute_dtype="bf16", offload_param=_nvme(tmp_path / "nope"))
    with pytest.raises(RuntimeError, match=r"offload_param\.nvme_path = '.*nope': no such folder"):
        launch.run_threads(_one_engine, 1, args=(params_missing,))
    assert os.listdir(tmp_path) == []  # nothing written


def test_the_files_go_when_the_engine_does(tmp_path):
    import gc

    def run(rank, world):
        model = _net()
        engine = fz3.initialize(model, torch.optim.AdamW(model.parameters()),
                                fz3.Config(offload_optimizer=_nvme(tmp_path)))
        engine.backward(engine(torch.randn(2, 8)).sum())
        engine.step()
        during = os.listdir(tmp_path)
        engine.offload.close()
        return during
    during = launch.run_threads(run, 1)[0]
    gc.collect()
    assert len(during) == 1 and during[0].startswith("fz3-rank0-") and os.listdir(tmp_path) == []


def _silently_ignored_by_deepspeed(zero: dict) -> bool:
    """Where DeepSpeed 0.19.8 takes an offload key and does not offload: params below stage 3,
    the optimizer at stage 0, "nvme" at stages 1 and 2 (kept in host memory)."""
    stage, opt, par = zero.get("stage", 3), zero.get("offload_optimizer", {}), zero.get("offload_param", {})
    return bool((par and stage < 3) or (opt and stage == 0) or (opt.get("device") == "nvme" and stage in (1, 2)))


def test_deepspeed_refusals_and_silences_are_errors_here():
    """Every case DeepSpeed 0.19.8 ran or refused here: where it refuses the keys (a device it
    does not know, a ratio past 1, a partial ratio below stage 3, nvme without a path) fz3
    refuses, naming the key; where it takes them and silently does not offload (its losses are
    those without offload) fz3 says so instead; the rest fz3 takes."""
    cases = json.load(open(RECORD))["cases"]
    assert "Input should be 'none', 'cpu' or 'nvme'" in cases["device_gpu"]["error"]["message"]
    for name, case in cases.items():
        zero = case["zero_optimization"]
        # not refusals of the keys: DeepSpeed's NVMe op does not build here (no libaio), and its
        # partial offload wants its own CPU Adam, not the torch AdamW the recorder asks for
        refused = "error" in case and not any(w in case["error"]["message"] for w in ("async_io", "Hybrid Optimizer"))
        silent = _silently_ignored_by_deepspeed(zero)
        if silent and "value" in case:  # the premise, from the record: the same losses as no offload
            assert case["value"]["losses"] == cases[f"stage{zero['stage']}_none"]["value"]["losses"], name
        if not (refused or silent):
            config = fz3.Config.from_deepspeed({"zero_optimization": zero})
            assert config.offload_optimizer.on or config.offload_param.on or name.endswith("_none"), name
            continue
        with pytest.raises(ValueError) as e:
            fz3.Config.from_deepspeed({"zero_optimization": zero})
        said = str(e.value)
        assert "zero_optimization.offload" in said, (name, said)
        if silent:
            assert "silently" in said or "host memory" in said, (name, said)


HF_ZERO3_OFFLOAD = {  # transformers' DeepSpeed docs, "ZeRO-3 example", as published
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
                          "contiguous_gradients": True, "sub_group_size": 1e9, "stage3_max_live_parameters": 1e9,
                          "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
}


def _hf_json(rank: int, world: int) -> list[float]:
    model = _net()
    engine = fz3.initialize(model, torch.optim.AdamW(model.parameters(), lr=0.01),
                            fz3.Config.from_deepspeed(HF_ZERO3_OFFLOAD))
    losses = []
    for i in range(3):
        loss = engine(torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * i + rank))).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_hf_documented_zero3_json_trains_as_published_on_cpu_ranks(caplog):
    """"cpu" offload on CPU ranks: accepted, said once in the log, nothing moves (the losses are
    those of the same JSON without the offload sections)."""
    caplog.set_level("INFO", logger="fz3")
    got = launch.run_threads(_hf_json, 2)
    plain = dict(HF_ZERO3_OFFLOAD["zero_optimization"])
    plain.pop("offload_optimizer"), plain.pop("offload_param")
    assert any("offload_optimizer 'cpu': the ranks compute on the CPU" in r.getMessage() for r in caplog.records)
    HF_ZERO3_OFFLOAD["zero_optimization"], saved = plain, HF_ZERO3_OFFLOAD["zero_optimization"]
    try:
        want = launch.run_threads(_hf_json, 2)
    finally:
        HF_ZERO3_OFFLOAD["zero_optimization"] = saved
    assert got == want


@pytest.mark.parametrize("bucket", [50_000_000, 200])
def test_params_on_nvme_train_as_in_memory(tmp_path, bucket):
    """offload_param "nvme" with the optimizer on NVMe: the shards leave memory with the masters and
    every gather reads them from disk, read ahead of it once the trace is recorded (only a pass's
    first gather waits: the default prefetch_bucket_size holds this model twice over; with 200
    elements, less than two layers, some wait); the numbers are those in memory, bit for bit."""
    base = fz3.Config(param_persistence_threshold=0, sub_group_size=300, prefetch_bucket_size=bucket)
    plain = launch.run_threads(_train, 2, args=(base, 3, "adamw"))
    both = base.replace(offload_optimizer=_nvme(tmp_path), offload_param=_nvme(tmp_path))
    off = launch.run_threads(_train, 2, args=(both, 3, "adamw"))
    for a, b in zip(plain, off):
        assert_same_run(a, b)
        s = b["stats"]
        # every step's gathers read the shards: more than the optimizer's own reads
        assert s["step_disk_bytes_read"] > s["step_disk_bytes_written"], s
        assert s["step_param_reads_ahead"] > 0, s
        assert s["step_param_reads_waited"] == 1 if bucket > 1000 else s["step_param_reads_waited"] > 1, s


@pytest.mark.parametrize("dtype, optimizer", [("bf16", "nvme"), ("fp32", "none"), ("bf16", "cpu")])
def test_params_on_nvme_in_files_of_their_own_train_as_in_memory(tmp_path, dtype, optimizer):
    """offload_param "nvme" in bf16, or without the optimizer on NVMe: the compute shards are
    copies of the masters, written to files of their own after each refresh and read by the
    gathers (ahead of them from the second window); bit for bit the run in memory."""
    base = fz3.Config(compute_dtype=dtype, param_persistence_threshold=0, sub_group_size=300)
    plain = launch.run_threads(_train, 2, args=(base, 3, "adamw"))
    config = base.replace(offload_param=_nvme(tmp_path),
                          offload_optimizer=_nvme(tmp_path) if optimizer == "nvme" else {"device": optimizer})
    off = launch.run_threads(_train, 2, args=(config, 3, "adamw"))
    for a, b in zip(plain, off):
        assert_same_run(a, b)
        s = b["stats"]
        assert s["step_param_reads_ahead"] > 0 and s["step_disk_bytes_read"] > 0, s
        assert s["step_disk_bytes_written"] > 0, s  # the refreshed shards, each step


def test_the_keys_fz3_does_not_act_on_are_reported():
    """DeepSpeed's buffer pools, libaio's settings, offload_param's pin_memory: kept in the Config
    as the JSON said, and named in the one "accepted but unused" warning; offload_optimizer's
    pin_memory pins the host step's buffers on an accelerator, so it is not named."""
    ds = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True,
                                                                  "buffer_count": 8},
                                "offload_param": {"device": "cpu", "pin_memory": True}},
          "aio": {"block_size": 4096, "queue_depth": 16}}
    with pytest.warns(UserWarning) as record:
        config = fz3.Config.from_deepspeed(ds)
    said = str(record[0].message)
    for key in ("zero_optimization.offload_param.pin_memory", "zero_optimization.offload_optimizer.buffer_count",
                "aio.queue_depth"):
        assert key in said, said
    assert "aio.block_size" not in said and "offload_optimizer.pin_memory" not in said and config.aio.block_size == 4096 and config.offload_optimizer.buffer_count == 8


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])  # the shards in the masters' files / in files of their own
def test_a_checkpoint_with_params_on_nvme_loads_in_memory_at_another_world_size(tmp_path, dtype):
    cfg = fz3.Config(param_persistence_threshold=0, sub_group_size=300, compute_dtype=dtype)
    both = cfg.replace(offload_optimizer=_nvme(tmp_path), offload_param=_nvme(tmp_path))
    path = str(tmp_path / "ckpt")
    before = launch.run_threads(_save_ckpt, 2, args=(both, path))[0]
    got = launch.run_threads(_load_ckpt, 3, args=(cfg, path))
    twin = launch.run_threads(_load_ckpt, 3, args=(both, path))
    back = launch.run_threads(_load_ckpt, 1, args=(both, path))
    for out in got + twin + back:
        for k, v in before["weights"].items():
            assert torch.equal(out["weights"][k], v), k
    for a, b in zip(got, twin):  # the next step, in memory or on disk, at the same world size
        for k in before["weights"]:
            assert torch.equal(a["after"][k], b["after"][k]), k


def _rank_with_offload(rank: int, world: int, path: str) -> int:
    model = _net()
    engine = fz3.initialize(model, torch.optim.AdamW(model.parameters()),
                            fz3.Config(offload_optimizer=_nvme(path)))
    engine.backward(engine(torch.randn(2, 8)).sum())
    engine.step()
    return len(os.listdir(path))


def test_the_files_go_when_a_launched_rank_ends(tmp_path):
    """fz3.launch's ranks end by os._exit (module doc of fz3/launch.py), which skips the exit
    handlers: the launcher closes the disk tiers first."""
    seen = launch.run(_rank_with_offload, world_size=2, args=(str(tmp_path),), timeout=120)
    assert seen and all(n >= 1 for n in seen) and os.listdir(tmp_path) == []


def _evaluations(rank: int, world: int, config: fz3.Config) -> dict:
    model = _net()
    engine = fz3.initialize(model, torch.optim.AdamW(model.parameters()), config)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(x).square().mean())
    engine.step()
    with torch.no_grad():
        outs = [engine(x) for _ in range(5)]  # passes with no optimizer step after them
    off = engine.offload
    return {"outs": outs, "recorded": None if off is None else (len(off.recording), len(off.disk_numel))}


def test_passes_without_a_step_keep_a_bounded_order_of_gathers(tmp_path, monkeypatch):
    """The order of a window's gathers (the next window's read-ahead queue) is kept up to
    RECORDED gathers of each param on disk: an evaluation loop that never steps does not grow
    it for good; its outputs are those in memory."""
    monkeypatch.setattr("fz3.shell.offload.RECORDED", 2)
    base = fz3.Config(param_persistence_threshold=0, sub_group_size=300, compute_dtype="bf16")
    plain = launch.run_threads(_evaluations, 2, args=(base,))
    off = launch.run_threads(_evaluations, 2, args=(base.replace(offload_param=_nvme(tmp_path)),))
    for a, b in zip(plain, off):
        assert all(torch.equal(x, y) for x, y in zip(a["outs"], b["outs"]))
        recorded, on_disk = b["recorded"]
        assert 0 < recorded <= 2 * on_disk < 5 * on_disk, b["recorded"]
