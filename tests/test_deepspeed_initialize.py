"""`fz3.deepspeed.initialize` and the engine's DeepSpeed surface (fz3/deepspeed/, fz3/shell/surface.py).

The config as DeepSpeed takes it (dict, JSON path, base64, args.deepspeed_config), the batch
sizes as DeepSpeed derives and checks them, "auto" as DeepSpeed 0.19.8 reads it, the four
return values, DeepSpeed's counters and boundary answers call for call ([Note: DeepSpeed's
counters]), save_16bit_model's file, and what load_checkpoint leaves in the counters. Ranks are
threads of this process (fz3.launch.run_threads): the real engine, no process group.
"""
from __future__ import annotations

import argparse
import base64
import json
import logging

import pytest
import torch
from torch import nn

import fz3
import fz3.deepspeed as deepspeed
from fz3 import launch
from fz3.deepspeed.settings import DeepSpeedConfigError, batch_sizes, read_config, read_settings

pytestmark = pytest.mark.timeout(300)

ZERO3 = {"zero_optimization": {"stage": 3}}


def net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def cfg(**top) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, **ZERO3, **top}


# ---- the config -------------------------------------------------------------------------------


def test_config_is_a_dict_a_json_path_or_base64(tmp_path):
    ds = cfg(gradient_accumulation_steps=2)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    encoded = base64.urlsafe_b64encode(json.dumps(ds).encode()).decode()
    assert read_config(ds) == read_config(str(path)) == read_config(path) == read_config(encoded) == ds


def test_a_missing_config_path_names_it(tmp_path):
    with pytest.raises(ValueError, match="nope.json.*no such file"):
        read_config(str(tmp_path / "nope.json"))


def test_a_duplicate_key_in_the_json_is_an_error(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 2, "train_batch_size": 4}')
    with pytest.raises(ValueError, match="duplicate key 'train_batch_size'"):
        read_config(str(path))


def test_args_deepspeed_config_is_read_and_not_with_config_too(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg()))
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    assert args.deepspeed and args.deepspeed_config == str(path)

    def fn(rank, world):
        m = net()
        engine, *_ = deepspeed.initialize(args=args, model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1))
        try:
            deepspeed.initialize(args=args, model=net(), config=cfg())
        except ValueError as e:
            return engine.train_micro_batch_size_per_gpu(), str(e)
    micro, err = launch.run_threads(fn, world_size=1)[0]
    assert micro == 2 and "both as args.deepspeed_config" in err


# ---- batch sizes: DeepSpeed's derivation and its errors ----------------------------------------

@pytest.mark.parametrize("given, world, want", [
    (dict(train_batch_size=16, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=4), 2, (16, 2, 4)),
    (dict(train_batch_size=16, train_micro_batch_size_per_gpu=2), 2, (16, 2, 4)),
    (dict(train_batch_size=16, gradient_accumulation_steps=4), 2, (16, 2, 4)),
    (dict(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=4), 2, (16, 2, 4)),
    (dict(train_batch_size=16), 2, (16, 8, 1)),
    (dict(train_micro_batch_size_per_gpu=3), 3, (9, 3, 1)),
    (dict(train_batch_size=8.0, train_micro_batch_size_per_gpu=4), 1, (8, 4, 2)),
])
def test_batch_sizes_are_derived_as_deepspeed_derives_them(given, world, want):
    assert batch_sizes(given, world_size=world) == want


@pytest.mark.parametrize("given, world, message", [
    (dict(train_batch_size=16, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2), 2,
     "train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size 16 != 2 * 2 * 2"),
    (dict(train_batch_size=6, train_micro_batch_size_per_gpu=4), 2, "Gradient accumulation steps: 0 has to be greater than 0"),
    (dict(gradient_accumulation_steps=2), 2, "Either train_batch_size or train_micro_batch_size_per_gpu"),
    (dict(train_batch_size=0, train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1), 1,
     "Train batch size: 0 has to be greater than 0"),
])
def test_batch_sizes_that_do_not_fit_the_world_are_deepspeeds_error(given, world, message):
    with pytest.raises(DeepSpeedConfigError, match=message.replace("*", r"\*")) as e:
        batch_sizes(given, world_size=world)
    assert isinstance(e.value, AssertionError) and isinstance(e.value, ValueError)


def test_a_batch_size_that_is_not_a_number_names_the_key():
    with pytest.raises(TypeError, match="'train_micro_batch_size_per_gpu' must be an integer, got '2'"):
        batch_sizes({"train_micro_batch_size_per_gpu": "2"}, world_size=1)


def test_settings_take_gradient_accumulation_from_the_batch_sizes():
    s = read_settings({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 2, **ZERO3}, world_size=3)
    assert (s.config.gradient_accumulation_steps, s.train_batch_size, s.train_micro_batch_size_per_gpu) == (2, 12, 2)


# ---- "auto" ([Note: "auto"], fz3/config/deepspeed_keys.py) ----------------------------------------

def test_auto_in_a_section_is_deepspeeds_default_and_bf16_auto_is_off():
    s = read_settings(cfg(bf16={"enabled": "auto"}, fp16={"enabled": "auto"},
                          zero_optimization={"stage": 3, "reduce_bucket_size": "auto",
                                             "stage3_prefetch_bucket_size": "auto",
                                             "stage3_param_persistence_threshold": "auto",
                                             "stage3_gather_16bit_weights_on_model_save": "auto"}),
                      world_size=1)
    default = fz3.Config()
    assert s.config.compute_dtype == "fp32"
    assert (s.config.reduce_bucket_size, s.config.prefetch_bucket_size, s.config.param_persistence_threshold) == \
        (default.reduce_bucket_size, default.prefetch_bucket_size, default.param_persistence_threshold)
    assert s.gather_16bit_weights_on_model_save is False
    assert fz3.Config.from_deepspeed({"bf16": {"enabled": "auto"}, **ZERO3}).compute_dtype == "fp32"


@pytest.mark.parametrize("key", ["train_batch_size", "gradient_accumulation_steps", "gradient_clipping"])
def test_auto_where_deepspeed_fails_on_it_is_an_error_naming_the_key(key):
    with pytest.raises(ValueError, match=f"'{key}' is \"auto\""):
        read_settings(cfg(**{key: "auto"}), world_size=1)


# ---- what initialize returns and builds ----------------------------------------------------------

def test_initialize_returns_four_and_takes_callables_and_training_data():
    def fn(rank, world):
        data = torch.utils.data.TensorDataset(torch.arange(20.0).view(10, 2))
        m = net()
        engine, opt, loader, sched = deepspeed.initialize(
            model=m, model_parameters=m.parameters(), training_data=data, config=cfg(),
            optimizer=lambda params: torch.optim.SGD(params, lr=0.5),
            lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5))
        batches = [b[0][:, 0].tolist() for b in loader]
        return (type(engine).__name__, opt is engine.optimizer, sched is engine.lr_scheduler,
                type(loader.sampler).__name__, batches, engine.get_lr())
    out = launch.run_threads(fn, world_size=2)
    assert out[0][:4] == ("Engine", True, True, "DistributedSampler")
    seen = sorted(x for r in out for b in r[4] for x in b)
    assert seen == [2.0 * i for i in range(10)] and all(len(b) <= 2 for r in out for b in r[4])
    assert len(out[0][4]) == 3 and out[0][5] == [0.5]  # ceil(5 / 2) batches per rank; lr as built


@pytest.mark.parametrize("case, message", [
    ("client_and_json", "both as optimizer="),
    ("client_and_json_scheduler", "both as lr_scheduler="),
    ("no_optimizer", "no optimizer"),
    ("mpu", "mpu="),
    ("no_config", "needs a config"),
])
def test_initialize_refuses_what_it_cannot_honour(case, message):
    def fn(rank, world):
        m = net()
        kwargs = {"model": m, "config": cfg()}
        if case == "client_and_json":
            kwargs.update(optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                          config=cfg(optimizer={"type": "SGD", "params": {"lr": 0.1}}))
        elif case == "client_and_json_scheduler":
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            kwargs.update(optimizer=opt, lr_scheduler=torch.optim.lr_scheduler.StepLR(opt, 1),
                          config=cfg(scheduler={"type": "WarmupLR", "params": {}}))
        elif case == "mpu":
            kwargs.update(mpu=object(), optimizer=torch.optim.SGD(m.parameters(), lr=0.1))
        elif case == "no_config":
            kwargs.update(config=None)
        try:
            deepspeed.initialize(**kwargs)
        except ValueError as e:
            return str(e)
    assert message in launch.run_threads(fn, world_size=1)[0]


# ---- DeepSpeed's counters, call for call ([Note: DeepSpeed's counters]) --------------------------

def _loop(rank, world, gas, steps, tmp=None):
    m = net()
    engine, *_ = deepspeed.initialize(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                                      config=cfg(gradient_accumulation_steps=gas))
    rows = []
    for i in range(steps):
        before = engine.is_gradient_accumulation_boundary()
        engine.backward(engine(torch.full((2, 4), float(i + rank))).sum())
        after_backward = engine.is_gradient_accumulation_boundary()
        engine.step()
        rows.append(((before, after_backward, engine.is_gradient_accumulation_boundary()),
                     engine.global_steps, engine.global_samples, engine.micro_steps, engine.was_step_applied()))
    return engine, rows


def test_counters_and_boundary_answers_are_deepspeeds_call_for_call():
    rows = launch.run_threads(lambda r, w: _loop(r, w, gas=2, steps=4)[1], world_size=2)[0]
    # DeepSpeed 0.19.8, gas 2, world 2, micro 2: (F,F,T),(T,T,F); global_samples += 8 a boundary
    assert rows == [((False, False, True), 0, 0, 1, False), ((True, True, False), 1, 8, 2, True),
                    ((False, False, True), 1, 8, 3, False), ((True, True, False), 2, 16, 4, True)]


def test_counters_after_load_checkpoint_are_the_saved_ones_and_micro_steps_this_engines(tmp_path):
    def fn(rank, world):
        engine, _ = _loop(rank, world, gas=2, steps=4)
        engine.save_checkpoint(str(tmp_path))
        m = net(1)
        fresh, *_ = deepspeed.initialize(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                                         config=cfg(gradient_accumulation_steps=2))
        fresh.load_checkpoint(str(tmp_path))
        return fresh.global_steps, fresh.global_samples, fresh.micro_steps, fresh.skipped_steps, \
            fresh.is_gradient_accumulation_boundary()
    assert launch.run_threads(fn, world_size=2)[0] == (2, 16, 0, 0, False)


def test_module_methods_are_deepspeeds():
    def fn(rank, world):
        m = net()
        engine, *_ = deepspeed.initialize(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), config=cfg())
        assert engine.eval() is None and not m.training and not engine.training  # DeepSpeed returns None
        assert engine.train() is None and m.training
        names = [n for n, _ in engine.named_parameters()]
        same = [p for _, p in engine.named_parameters()] == list(engine.parameters()) == list(m.parameters())
        engine.backward(engine(torch.ones(2, 4)).sum())
        engine.zero_grad()
        try:
            with engine.no_sync():
                pass
        except AssertionError as e:
            sync = str(e)
        return names, same, all(p.grad is None for p in m.parameters()), sync, \
            (engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu(), engine.train_batch_size())
    names, same, no_grads, sync, sizes = launch.run_threads(fn, world_size=2)[0]
    assert names == ["module.0.weight", "module.0.bias", "module.2.weight", "module.2.bias"] and same
    assert no_grads and "incompatible with gradient partitioning logic of ZeRO stage 3" in sync
    assert sizes == (1, 2, 4)


def test_fz3_initialize_engines_say_they_have_no_batch_size():
    def fn(rank, world):
        m = net()
        engine = fz3.initialize(m, torch.optim.SGD(m.parameters(), lr=0.1), fz3.Config())
        engine.backward(engine(torch.ones(2, 4)).sum())
        engine.step()
        try:
            engine.train_batch_size()
        except ValueError as e:
            return engine.global_steps, engine.micro_steps, str(e)
    steps, micro, err = launch.run_threads(fn, world_size=1)[0]
    assert (steps, micro) == (1, 1) and "fz3.deepspeed.initialize" in err


# ---- save_16bit_model ---------------------------------------------------------------------------

class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(6, 4)
        self.norm = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 6, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.norm(self.emb(x)))


@pytest.mark.parametrize("bf16", [False, True])
def test_save_16bit_model_writes_the_whole_model_in_the_compute_dtype_from_rank_0(tmp_path, bf16):
    def fn(rank, world):
        m = Tied()
        ds = cfg(bf16={"enabled": bf16}, zero_optimization={"stage": 3, "stage3_gather_16bit_weights_on_model_save": True})
        engine, *_ = deepspeed.initialize(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), config=ds)
        engine.backward(engine(torch.tensor([rank, 1])).float().sum())
        engine.step()
        ok = engine.save_16bit_model(str(tmp_path), "weights.bin")
        return ok, engine.full_state_dict()
    out = launch.run_threads(fn, world_size=2)
    saved = torch.load(tmp_path / "weights.bin")
    full = out[0][1]
    want = torch.bfloat16 if bf16 else torch.float32
    assert out[0][0] and out[1][0] and list(saved) == list(full)
    assert saved["emb.weight"].dtype == want and saved["emb.weight"] is saved["head.weight"]
    for k, v in saved.items():
        expect = full[k].to(want) if full[k].is_floating_point() else full[k]
        assert torch.equal(v, expect), k


def test_save_16bit_model_without_the_switch_writes_nothing_and_says_so(tmp_path, caplog):
    def fn(rank, world):
        m = net()
        engine, *_ = deepspeed.initialize(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), config=cfg())
        return engine.save_16bit_model(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="fz3"):
        assert launch.run_threads(fn, world_size=2) == [False, False]
    assert not (tmp_path / "pytorch_model.bin").exists()
    assert "stage3_gather_16bit_weights_on_model_save is false" in caplog.text


# ---- zero and utils -----------------------------------------------------------------------------

def test_zero_and_utils_are_fz3s():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.b(self.a(x))

    def fn(rank, world):
        m = nn.Sequential(Block(), nn.Linear(4, 2))
        marked = deepspeed.utils.set_z3_leaf_modules(m, ["Block"])
        engine, *_ = deepspeed.initialize(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), config=cfg())
        with deepspeed.zero.GatheredParameters(list(m[1].parameters()), modifier_rank=0):
            if rank == 0:
                m[1].bias.data.fill_(3.0)
        with deepspeed.zero.GatheredParameters(m[1].bias):
            bias = m[1].bias.detach().clone()
        return [type(x).__name__ for x in marked], bias.tolist()
    out = launch.run_threads(fn, world_size=2)
    assert out[0] == out[1] == (["Block"], [3.0, 3.0])


def test_zero_init_refuses_offload_and_names_it():
    with pytest.raises(ValueError, match="remote_device='cpu'"):
        deepspeed.zero.Init(remote_device="cpu")
    with pytest.raises(ValueError, match="no modules of type"):
        deepspeed.utils.set_z3_leaf_modules(net(), ["Nothing"])
    assert deepspeed.utils.set_z3_leaf_modules(net(), ["Nothing"], raise_if_not_found=False) == []
