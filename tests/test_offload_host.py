"""The optimizer stepped on the host for an accelerator's ranks (ZeRO-Offload, issue #47), run on
CPU: Options(host_step=True) keeps "device" and "host" as two pools of memory, so the path an
accelerator takes runs here. Three things are checked against fz3/core/offload.py's schedule
(`host`):

- the same transfers are issued: each sub-group's grads to the host and its stepped values back,
  once a step, as many bytes as its shards hold;
- the step runs on the host copies: the optimizer's params are the host masters and the grads it
  reads are the host buffers, neither the device's grads nor the compute shards;
- the results are bit-equal to no offload (losses, weights, optimizer state), also with the
  optimizer on NVMe staged through the host, bf16, clipping and accumulation, and checkpoints
  load across it.

Thread ranks (fz3.launch.run_threads). On an accelerator the same code runs with CUDA/NPU tensors
and pinned host buffers: bench/gpu.sh's offload row."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fz3
from fz3 import launch
from tests.support.same_run import assert_same_run
from fz3.core import offload

HOST = fz3.Options(host_step=True)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))


def _train(rank: int, world: int, config: fz3.Config, options: fz3.Options, gas: int = 1) -> dict:
    model = _net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    engine = fz3.initialize(model, optimizer, config.replace(gradient_accumulation_steps=gas), options=options)
    store, seen = engine.store, []

    def on_the_host(opt, args, kwargs) -> None:  # what the optimizer reads, at each of its steps
        device = {s.grads.untyped_storage()._cdata for s in store.segments}
        device |= {t.untyped_storage()._cdata for t in store.shards}
        host = {s.host_grads.untyped_storage()._cdata for s in store.segments if s.host_grads is not None}
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    seen.append((p.untyped_storage()._cdata not in device, p.grad.untyped_storage()._cdata in host))

    optimizer.register_step_pre_hook(on_the_host)
    g = torch.Generator().manual_seed(rank)
    losses, steps = [], []
    for _ in range(3 * gas):
        loss = engine(torch.randn(4, 8, generator=g)).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if engine.was_step_applied():
            steps.append({k: v for k, v in engine.stats().items() if k.startswith("step_")})
    off = engine.offload
    return {"losses": losses, "weights": engine.full_state_dict(), "optimizer": engine.full_optimizer_state_dict(),
            "seen": seen, "steps": steps,
            "effects": None if off is None else (off.effects, off.groups, off.host),
            "shard_bytes": sum(s.numel() * s.element_size() for s in store.shards),
            "grad_bytes": sum(s.grads.numel() * 4 for s in store.segments)}


@pytest.mark.parametrize("dtype, device, sub_group_size, options, gas", [
    ("fp32", "cpu", 1_000_000_000, {}, 1),  # DeepSpeed's defaults: one sub-group
    ("bf16", "cpu", 300, {}, 2),
    ("bf16", "nvme", 300, {"pipeline_read": True, "pipeline_write": True}, 1),
    ("fp32", "nvme", 500, {"ratio": 0.5}, 1),
])
def test_the_host_step_issues_the_schedules_copies_and_equals_no_offload(tmp_path, dtype, device, sub_group_size,
                                                                         options, gas):
    base = fz3.Config(compute_dtype=dtype, param_persistence_threshold=0, gradient_clipping=1.0,
                      sub_group_size=sub_group_size)
    section = {"device": device, **({"nvme_path": str(tmp_path)} if device == "nvme" else {}), **options}
    plain = launch.run_threads(_train, 2, args=(base, fz3.Options(), gas))
    host = launch.run_threads(_train, 2, args=(base.replace(offload_optimizer=section), HOST, gas))
    for a, b in zip(plain, host):
        assert_same_run(a, b)
        effects, groups, on_host = b["effects"]
        assert on_host and effects == offload.schedule(groups, read_ahead=options.get("pipeline_read", False),
                                                       write_behind=options.get("pipeline_write", False), host=True)
        # the transfers: every sub-group's grads up and its stepped values down, once a step
        assert len(b["steps"]) == 3
        for s in b["steps"]:
            assert s["step_copies_to_host"] == s["step_copies_to_device"] == len(groups), s
            assert s["step_bytes_to_host"] == b["grad_bytes"] and s["step_bytes_to_device"] == b["shard_bytes"], s
            if device == "nvme":
                assert s["step_disk_bytes_read"] > 0 and s["step_disk_bytes_written"] > 0, s
        if sub_group_size < 1000:
            assert len(groups) > 1, groups
        # the step ran on the host copies: params apart from the device's, grads from the host buffers
        assert b["seen"] and all(apart and from_host for apart, from_host in b["seen"]), b["seen"]
        assert a["effects"] is None  # no offload, no sub-groups: the flat step


def test_params_in_host_memory_are_copied_to_the_device_for_each_gather():
    """offload_param "cpu" with the host step (HF's documented ZeRO-3 JSON on an accelerator): the
    compute shards live in host memory beside the masters, so the step copies nothing to the
    device, and every gather copies its shards there; bit-equal to no offload."""
    base = fz3.Config(compute_dtype="bf16", param_persistence_threshold=0, sub_group_size=300)
    plain = launch.run_threads(_train, 2, args=(base, fz3.Options()))
    both = base.replace(offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"})
    host = launch.run_threads(_train, 2, args=(both, HOST))
    for a, b in zip(plain, host):
        assert_same_run(a, b)
        for s in b["steps"]:
            assert s["step_bytes_to_device"] == 0 and s["step_bytes_to_host"] == b["grad_bytes"], s
            # at least one gather of every param a step (the refresh after it, here)
            assert s["step_param_bytes_to_device"] >= b["shard_bytes"], s


def test_params_in_host_memory_without_the_optimizer_there_move_nothing_on_cpu_ranks():
    """Without the optimizer's offload there is no host step (on an accelerator: refused by name)."""
    cfg = fz3.Config(param_persistence_threshold=0, offload_param={"device": "cpu"})
    out = launch.run_threads(_train, 1, args=(cfg, HOST))
    assert out[0]["effects"] is None


def test_cpu_offload_on_cpu_ranks_moves_nothing_without_the_option():
    """Without Options(host_step=True), "cpu" on CPU ranks is where the data already lives."""
    cfg = fz3.Config(param_persistence_threshold=0, offload_optimizer={"device": "cpu"})
    out = launch.run_threads(_train, 2, args=(cfg, fz3.Options()))
    assert all(o["effects"] is None for o in out)


def _save(rank: int, world: int, config: fz3.Config, options: fz3.Options, path: str) -> dict:
    model = _net()
    engine = fz3.initialize(model, torch.optim.AdamW(model.parameters(), lr=0.01), config, options=options)
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        engine.backward(engine(torch.randn(4, 8, generator=g)).square().mean())
        engine.step()
    engine.save_checkpoint(path, tag="t")
    return engine.full_state_dict()


def _load(rank: int, world: int, config: fz3.Config, options: fz3.Options, path: str) -> dict:
    model = _net()
    engine = fz3.initialize(model, torch.optim.AdamW(model.parameters(), lr=0.01), config, options=options)
    engine.load_checkpoint(path, tag="t")
    before = engine.full_state_dict()
    engine.backward(engine(torch.randn(4, 8, generator=torch.Generator().manual_seed(7))).square().mean())
    engine.step()
    return {"loaded": before, "after": engine.full_state_dict()}


def test_checkpoints_cross_the_host_step_and_world_sizes(tmp_path):
    """Saved on 2 ranks with the host step, loaded on 3 with and without it and on 1 with it: the
    weights as saved, and the next step on 3 ranks the same either way."""
    cfg = fz3.Config(param_persistence_threshold=0, sub_group_size=300, compute_dtype="bf16")
    on = cfg.replace(offload_optimizer={"device": "cpu"})
    path = str(tmp_path / "ckpt")
    saved = launch.run_threads(_save, 2, args=(on, HOST, path))[0]
    plain = launch.run_threads(_load, 3, args=(cfg, fz3.Options(), path))[0]
    host = launch.run_threads(_load, 3, args=(on, HOST, path))[0]
    alone = launch.run_threads(_load, 1, args=(on, HOST, path))[0]
    for k, v in saved.items():
        assert all(torch.equal(out["loaded"][k], v) for out in (plain, host, alone)), k
        assert torch.equal(plain["after"][k], host["after"][k]), k


def test_a_partial_cpu_ratio_on_the_host_step_is_refused():
    cfg = fz3.Config(param_persistence_threshold=0, offload_optimizer={"device": "cpu", "ratio": 0.5})
    with pytest.raises(RuntimeError, match=r"ValueError: .*offload_optimizer.ratio = 0.5 with device 'cpu'.*set ratio 1"):
        launch.run_threads(_train, 1, args=(cfg, HOST))
