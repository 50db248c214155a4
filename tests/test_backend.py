"""The process-group backend follows the device (fz3/shell/pick.py, fz3/launch.py): the choice
and the fit check on simulated CUDA / NPU machines (test_device's fake probe and torch), then
real 1-rank gloo runs: CPU works, a backend that does not fit is refused at init and at initialize."""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from fz3 import launch
from fz3.shell.pick import backend_for, backend_in, check_group_backend, pick_device
from test_device import CUDA, NPU, FakeProbe, fake_torch

pytestmark = pytest.mark.timeout(120)


def device_on(machine, env=None):
    """The device pick_device chooses on a simulated machine."""
    return pick_device(env=env or {}, probe=FakeProbe(**machine), torch_module=fake_torch())


@pytest.mark.parametrize("spec, kind, want", [
    ("gloo", "cpu", "gloo"),
    ("gloo", "cuda", "gloo"),                       # a bare name stands for every device type
    ("cpu:gloo,cuda:gloo", "cuda", "gloo"),          # what init_process_group('gloo') reports
    ("cpu:gloo,cuda:nccl", "cuda", "nccl"),
    ("cpu:gloo,cuda:nccl", "cpu", "gloo"),
    (" CPU:Gloo, cuda:NCCL ", "cuda", "nccl"),
    ("npu:hccl", "npu", "hccl"),
    ("cpu:gloo", "cuda", None),
    ("", "cpu", None),
])
def test_backend_in_reads_a_spec(spec, kind, want):
    assert backend_in(spec, kind) == want


@pytest.mark.parametrize("machine, env, backend, want", [
    (NPU, {}, None, "hccl"),
    (CUDA, {"LOCAL_RANK": "1"}, None, "nccl"),
    ({}, {}, None, "gloo"),
    (CUDA, {"FZ3_DEVICE": "cpu"}, None, "gloo"),
    (CUDA, {}, "nccl", "nccl"),
    (CUDA, {}, "cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl"),  # passed on as given
    ({}, {}, "cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl"),
    ({}, {}, "gloo", "gloo"),
    (NPU, {}, "hccl", "hccl"),
])
def test_backend_for_chooses_the_devices_backend(machine, env, backend, want):
    assert backend_for(device_on(machine, env), backend) == want


@pytest.mark.parametrize("machine, env, backend, words", [
    (CUDA, {}, "gloo", ["backend='gloo'", "cuda:0", "needs 'nccl'", "FZ3_DEVICE"]),
    (CUDA, {}, "cpu:gloo,cuda:gloo", ["'cpu:gloo,cuda:gloo'", "needs 'nccl'"]),
    (NPU, {"LOCAL_RANK": "3"}, "nccl", ["backend='nccl'", "npu:3", "needs 'hccl'"]),
    (NPU, {}, "cpu:gloo,cuda:nccl", ["needs 'hccl'"]),          # no entry for npu
    ({}, {}, "nccl", ["backend='nccl'", "device cpu", "needs 'gloo'", "npu with hccl"]),
    (CUDA, {"FZ3_DEVICE": "cpu"}, "nccl", ["backend='nccl'", "device cpu", "needs 'gloo'"]),
])
def test_backend_for_refuses_a_backend_that_does_not_fit(machine, env, backend, words):
    with pytest.raises(ValueError) as info:
        backend_for(device_on(machine, env), backend)
    assert all(w in str(info.value) for w in words), str(info.value)


@pytest.mark.parametrize("machine, config", [
    ({}, "cpu:gloo,cuda:gloo"),
    ({}, "cpu:gloo"),
    ({}, "cpu:gloo,cuda:nccl"),
    (CUDA, "cuda:nccl"),
    (CUDA, "cpu:gloo,cuda:nccl"),
    (NPU, "npu:hccl"),
    (NPU, "cpu:gloo,npu:hccl"),
])
def test_check_group_backend_accepts_a_fitting_group(monkeypatch, machine, config):
    asked = []
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: asked.append(group) or config)
    group = object()
    check_group_backend(device_on(machine), group)
    assert asked == [group]  # the group fz3 will use, not always the default one


@pytest.mark.parametrize("machine, config, words", [
    (CUDA, "cpu:gloo,cuda:gloo", ["'cpu:gloo,cuda:gloo'", "gloo for cuda", "cuda:0", "needs 'nccl'",
                                  "backend='nccl'", "fz3.launch.init_from_env()"]),
    (CUDA, "npu:hccl", ["nothing for cuda", "needs 'nccl'"]),
    (NPU, "cpu:gloo,cuda:nccl", ["nothing for npu", "npu:0", "backend='hccl'"]),
    ({}, "cuda:nccl", ["'cuda:nccl'", "nothing for cpu", "device is cpu", "backend='gloo'"]),
])
def test_check_group_backend_refuses_a_group_that_does_not_fit(monkeypatch, machine, config, words):
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    with pytest.raises(RuntimeError) as info:
        check_group_backend(device_on(machine))
    assert all(w in str(info.value) for w in words), str(info.value)


@pytest.mark.parametrize("machine, env, backend, want", [
    (CUDA, {"LOCAL_RANK": "1"}, None, [("set_device_index", 1), ("init", "nccl", "cuda:1")]),
    (NPU, {}, None, [("set_device_index", 0), ("init", "hccl")]),
    (NPU, {}, "cpu:gloo,npu:hccl", [("set_device_index", 0), ("init", "cpu:gloo,npu:hccl")]),
    ({}, {}, None, [("init", "gloo")]),
    (CUDA, {}, "gloo", ValueError),
    (CUDA, {}, None, "initialised"),  # a group already there is left as it is
])
def test_init_from_env_sets_the_device_then_inits_its_backend(monkeypatch, machine, env, backend, want):
    tm = fake_torch()
    log = tm.accelerator.log
    monkeypatch.setattr(launch, "pick_device",
                        lambda: pick_device(env=env, probe=FakeProbe(**machine), torch_module=tm))
    monkeypatch.setattr(dist, "is_initialized", lambda: want == "initialised")
    monkeypatch.setattr(dist, "init_process_group",  # NCCL is told its device (device_id)
                        lambda b, timeout, **kw: log.append(("init", b, *map(str, kw.values()))))
    monkeypatch.setattr(dist, "get_rank", lambda: 3)
    monkeypatch.setattr(dist, "get_world_size", lambda: 8)
    if want is ValueError:
        with pytest.raises(ValueError, match="backend='gloo' does not fit"):
            launch.init_from_env(backend=backend)
        assert log == []  # refused before touching the device
        return
    assert launch.init_from_env(backend=backend) == (3, 8)
    assert log == ([] if want == "initialised" else want)


# --- real 1-rank gloo runs -------------------------------------------------------------------


def _worker(rank: int, world: int) -> dict:
    """The group's backend; fz3.initialize refusing it for a (pretend) CUDA rank, then accepting
    it for the CPU rank and training a step."""
    import fz3
    from fz3 import api
    from fz3.shell.device import AcceleratorDevice

    net = nn.Linear(4, 2)
    real_pick = api.pick_device
    api.pick_device = lambda: AcceleratorDevice("cuda", 0)  # built without touching a GPU
    try:
        fz3.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1))
        refused = None
    except RuntimeError as e:
        refused = str(e)
    finally:
        api.pick_device = real_pick
    engine = fz3.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1))
    engine.backward(engine(torch.ones(3, 4)).sum())
    engine.step()
    return {"backend": dist.get_backend(), "config": dist.get_backend_config(), "refused": refused}


@pytest.mark.parametrize("backend, config, for_cuda", [
    (None, "cpu:gloo,cuda:gloo", "gloo for cuda"),
    ("cpu:gloo", "cpu:gloo", "nothing for cuda"),  # an explicit backend is the one used
])
def test_run_on_cpu_inits_gloo_and_initialize_checks_it(monkeypatch, backend, config, for_cuda):
    monkeypatch.delenv("FZ3_DEVICE", raising=False)
    out = launch.run(_worker, world_size=1, backend=backend, timeout=90)[0]
    assert out["config"] == config
    assert out["refused"] is not None and all(w in out["refused"] for w in [
        f"'{config}'", for_cuda, "cuda:0", "needs 'nccl'", "fz3.launch.init_from_env()"]), out


def _nothing(rank: int, world: int) -> None:
    return None


@pytest.mark.parametrize("env, backend, words", [
    ({"FZ3_DEVICE": "cpu"}, "nccl", ["backend='nccl' does not fit", "device cpu", "needs 'gloo'"]),
    ({"FZ3_DEVICE": "cuda"}, "nccl", ["FZ3_DEVICE='cuda'", "no accelerator"]),
])
def test_run_refuses_a_device_and_backend_that_do_not_fit(monkeypatch, env, backend, words):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(RuntimeError, match="a rank failed") as info:
        launch.run(_nothing, world_size=1, backend=backend, timeout=60)
    assert all(w in str(info.value) for w in words), str(info.value)
