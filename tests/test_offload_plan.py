"""fz3.plan with optimizer offload (issue #47 point 5): the bytes it says each step reads and
writes are what a real run's engine.stats() counts; given the memory a rank has, it chooses the
smallest share of the optimizer to offload that fits, as DeepSpeed's ratio picks the sub-groups;
a ratio set by hand is honoured; the command line takes --device-memory."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fz3
from fz3 import launch
from fz3.observe import offload_plan


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])


X = torch.randn(4, 64)
BASE = fz3.Config(param_persistence_threshold=0, sub_group_size=3000)


def _run(rank: int, world: int, config: fz3.Config, steps: int = 2) -> list[dict]:
    model = _net()
    engine = fz3.initialize(model, torch.optim.AdamW(model.parameters()), config)
    out = []
    for _ in range(steps):
        engine.backward(engine(X).square().mean())
        engine.step()
        out.append(engine.stats())
    return out


def test_the_plan_counts_what_the_disk_reads_and_writes(tmp_path):
    config = BASE.replace(offload_optimizer={"device": "nvme", "nvme_path": str(tmp_path), "ratio": 0.5})
    p = fz3.plan(_net(), config, world_size=2, example_inputs=(X,), steps=2)
    real = launch.run_threads(_run, 2, args=(config,))[0]
    assert p.offload.subgroups == real[1]["subgroups"] and len(p.offload.offloaded) == real[1]["offloaded_subgroups"]
    assert 0 < len(p.offload.offloaded) < p.offload.subgroups  # a partial ratio
    # from the second step on the optimizer state exists and travels with the masters
    assert p.steps[1]["disk_read_bytes"] == real[1]["step_disk_bytes_read"]
    assert p.steps[1]["disk_written_bytes"] == real[1]["step_disk_bytes_written"]


def test_with_params_on_nvme_the_plan_counts_the_gathers_reads(tmp_path):
    config = BASE.replace(offload_optimizer={"device": "nvme", "nvme_path": str(tmp_path)},
                          offload_param={"device": "nvme", "nvme_path": str(tmp_path)})
    p = fz3.plan(_net(), config, world_size=2, example_inputs=(X,), steps=3)
    real = launch.run_threads(_run, 2, args=(config, 3))[0]
    # a steady window reads each shard its gathers take once, read ahead in the last window's order
    assert p.steps[2]["disk_read_bytes"] == real[2]["step_disk_bytes_read"] > p.steps[2]["disk_written_bytes"]
    assert real[2]["step_param_reads_ahead"] > 0
    assert p.steps[2]["param_shards"] == 0  # the shards are the masters, on disk
    assert 0 < p.steps[2]["param_read_ahead_bytes"] <= 4 * config.prefetch_bucket_size


def test_given_the_memory_the_plan_chooses_the_smallest_ratio_that_fits():
    plain = fz3.plan(_net(), BASE, world_size=2, example_inputs=(X,), steps=2)
    budget = int(max(s["model_state_peak_bytes"] for s in plain.steps) * 0.9)
    p = fz3.plan(_net(), BASE, world_size=2, example_inputs=(X,), steps=2, device_memory=budget)
    assert p.fits and p.chosen is not None and p.chosen.offload_optimizer.device == "nvme"
    ratio = p.chosen.offload_optimizer.ratio
    n = p.offload.subgroups
    rs = offload_plan.ratios(n)
    assert ratio in rs and ratio > 0
    # the chosen ratio, set by hand, plans the same and fits; one sub-group fewer does not
    by_hand = BASE.replace(offload_optimizer={"device": "nvme", "nvme_path": "/x", "ratio": ratio})
    again = fz3.plan(_net(), by_hand, world_size=2, example_inputs=(X,), steps=2, device_memory=budget)
    assert again.fits and again.chosen is None and again.steps == p.steps
    fewer = by_hand.replace(offload_optimizer={"device": "nvme", "nvme_path": "/x", "ratio": rs[rs.index(ratio) - 1]})
    assert not fz3.plan(_net(), fewer, world_size=2, example_inputs=(X,), steps=2, device_memory=budget).fits
    assert f"chosen to fit: offload_optimizer {{device: nvme, nvme_path: <your drive>, ratio: {ratio:g}}}" in p.table()


def test_a_budget_nothing_fits_is_said():
    p = fz3.plan(_net(), BASE, world_size=2, example_inputs=(X,), device_memory=1000)
    assert not p.fits and p.chosen is None and "no share of the optimizer on disk" in p.table()


def test_deepspeeds_rule_gives_each_count_of_subgroups():
    for n in (1, 2, 3, 9, 250):
        for k, r in enumerate(offload_plan.ratios(n)):
            assert n - int((1 - r) * n) == k


@pytest.mark.parametrize("text", ["lots", "-3GB", "80XB"])
def test_the_command_line_refuses_a_size_it_cannot_read(text, capsys):
    from fz3.__main__ import main
    assert main(["plan", "examples/05_plan.py:tiny_llama", "--world-size", "2", f"--device-memory={text}"]) == 2
    assert "--device-memory" in capsys.readouterr().err


def test_the_command_line_says_whether_the_plan_fits(capsys):
    from fz3.__main__ import main
    assert main(["plan", "examples/05_plan.py:tiny_llama", "--world-size", "2", "--device-memory", "1GiB"]) == 0
    assert "device memory 1.00 GiB a rank: the plan fits" in capsys.readouterr().out


def _host_bytes(rank: int, world: int, config: fz3.Config) -> dict:
    """What a host-step run holds (Options(host_step=True): the accelerator's path on CPU): the
    host pool (masters, the grads' copies, the optimizer state, the params' shards with
    offload_param "cpu") and the device pool's shards, after two steps."""
    model = _net()
    engine = fz3.initialize(model, torch.optim.AdamW(model.parameters()), config,
                            options=fz3.Options(host_step=True))
    for _ in range(2):
        engine.backward(engine(X).square().mean())
        engine.step()
    store = engine.store
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    state = [v for s in engine.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    shards = nbytes(store.shards)
    host = nbytes(store.masters) + nbytes(s.host_grads for s in store.segments) + nbytes(state)
    return {"host": host + (shards if store.params_on_host else 0), "device_shards": 0 if store.params_on_host
            else shards}


@pytest.mark.parametrize("dtype, params", [("fp32", "none"), ("bf16", "none"), ("bf16", "cpu")])
def test_on_an_accelerator_the_plan_puts_the_optimizer_in_host_memory(dtype, params):
    """backend nccl with offload_optimizer "cpu": the masters, the optimizer state and the grads'
    copies leave the device's model states for the host row, byte for byte what a host-step run
    holds there; the device keeps compute shards of its own (in fp32 too), or none with the
    params in host memory."""
    base = BASE.replace(compute_dtype=dtype)
    config = base.replace(offload_optimizer={"device": "cpu"}, offload_param={"device": params})
    plain = fz3.plan(_net(), base, world_size=2, example_inputs=(X,), steps=2, backend="nccl").steps[1]
    p = fz3.plan(_net(), config, world_size=2, example_inputs=(X,), steps=2, backend="nccl")
    real = launch.run_threads(_host_bytes, 2, args=(config,))[0]
    s = p.steps[1]
    assert s["host_bytes"] == real["host"] and s["param_shards"] == real["device_shards"], (s, real)
    assert s["optimizer_state_bytes"] == 0 and s["model_state_peak_bytes"] < plain["model_state_peak_bytes"]
    assert "host memory (masters, state, grads' copies)" in p.table()


@pytest.mark.parametrize("dtype, optimizer", [("bf16", "nvme"), ("fp32", "none")])
def test_with_params_in_files_of_their_own_the_plan_counts_the_disk(tmp_path, dtype, optimizer):
    """offload_param "nvme" where the shards are not the masters: the shards' bytes leave the
    model states for the disk, written once a step and read by the gathers, as the run counts."""
    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
    config = BASE.replace(compute_dtype=dtype, offload_param=nvme,
                          offload_optimizer=nvme if optimizer == "nvme" else {"device": optimizer})
    plain = fz3.plan(_net(), BASE.replace(compute_dtype=dtype), world_size=2, example_inputs=(X,), steps=3)
    p = fz3.plan(_net(), config, world_size=2, example_inputs=(X,), steps=3)
    real = launch.run_threads(_run, 2, args=(config, 3))[0]
    s = p.steps[2]
    assert s["disk_read_bytes"] == real[2]["step_disk_bytes_read"], (s, real[2])
    assert s["disk_written_bytes"] == real[2]["step_disk_bytes_written"], (s, real[2])
    # the shards in memory: no more than in the plain run (fp32 with the optimizer in memory: the
    # same, the masters stay; the shards' copies are on disk)
    assert s["param_shards"] <= plain.steps[2]["param_shards"]
    if optimizer == "nvme":
        assert s["model_state_peak_bytes"] < plain.steps[2]["model_state_peak_bytes"]
