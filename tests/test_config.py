"""Config validation and Config.from_deepspeed (fz3/core/config.py, fz3/core/_deepspeed_keys.py)."""
from __future__ import annotations

import dataclasses
import warnings

import pytest

from fz3.core.config import Config

ZERO3 = {"stage": 3}


def ds(zero=None, **top):
    return {"zero_optimization": {**ZERO3, **(zero or {})}, **top}


def test_defaults_are_deepspeeds():
    c = Config()
    assert (c.prefetch_bucket_size, c.max_live_parameters, c.max_reuse_distance,
            c.param_persistence_threshold, c.reduce_bucket_size) == (
        50_000_000, 1_000_000_000, 1_000_000_000, 100_000, 500_000_000)
    assert (c.contiguous_gradients, c.reduce_scatter, c.overlap_comm) == (True, True, True)
    assert (c.gradient_accumulation_steps, c.gradient_clipping, c.compute_dtype) == (1, 0.0, "fp32")
    assert c.reduce_path == "reduce_scatter" and c.replace(reduce_scatter=False).reduce_path == "allreduce"


INVALID = [
    (dict(prefetch_bucket_size=-1), ValueError),
    (dict(max_live_parameters=1.5), TypeError),
    (dict(max_reuse_distance=True), TypeError),
    (dict(param_persistence_threshold=5e7), TypeError),  # Config wants ints; from_deepspeed converts
    (dict(reduce_bucket_size=0), ValueError),
    (dict(gradient_accumulation_steps=0), ValueError),
    (dict(contiguous_gradients=1), TypeError),
    (dict(debug_checks="yes"), TypeError),
    (dict(gloo_reduce_scatter=True), ValueError),
    (dict(gloo_all_gather="ring"), ValueError),
    (dict(gradient_clipping=-1.0), ValueError),
    (dict(gradient_clipping=True), ValueError),
    (dict(gradient_clipping=float("nan")), ValueError),
    (dict(compute_dtype="fp16"), ValueError),
    (dict(contiguous_gradients=False, reduce_scatter=False), ValueError),
]


@pytest.mark.parametrize("fields,error", INVALID, ids=[str(f) for f, _ in INVALID])
def test_invalid_fields(fields, error):
    with pytest.raises(error, match=next(iter(fields))):
        Config(**fields)


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().prefetch_bucket_size = 1  # type: ignore[misc]


def test_minimal_deepspeed_config_gives_defaults():
    """Stage-3 knobs take DeepSpeed's defaults, and so does clipping: DeepSpeed 0.19 clips at
    1.0 when the JSON has no gradient_clipping (Config() itself leaves clipping off)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to report
        assert Config.from_deepspeed(ds()) == Config(gradient_clipping=1.0)
    assert Config.from_deepspeed(ds(gradient_clipping=0.0)).gradient_clipping == 0.0


def test_full_translation():
    got = Config.from_deepspeed(ds(
        {"stage3_prefetch_bucket_size": 5e7, "stage3_max_live_parameters": 1e6,
         "stage3_max_reuse_distance": 0, "stage3_param_persistence_threshold": 1e4,
         "reduce_bucket_size": 2e8, "contiguous_gradients": True, "reduce_scatter": False,
         "overlap_comm": False},
        bf16={"enabled": True}, gradient_accumulation_steps=4, gradient_clipping=1.0))
    assert got == Config(prefetch_bucket_size=50_000_000, max_live_parameters=1_000_000,
                         max_reuse_distance=0, param_persistence_threshold=10_000,
                         reduce_bucket_size=200_000_000, reduce_scatter=False, overlap_comm=False,
                         gradient_accumulation_steps=4, gradient_clipping=1.0, compute_dtype="bf16")
    assert isinstance(got.prefetch_bucket_size, int)


@pytest.mark.parametrize("zero,field,value", [
    ({"prefetch_bucket_size": 7}, "prefetch_bucket_size", 7),  # DeepSpeed's alias
    ({"max_live_parameters": 8.0}, "max_live_parameters", 8),
    ({"overlap_comm": None}, "overlap_comm", True),  # None means True at stage 3
])
def test_aliases_and_specials(zero, field, value):
    assert getattr(Config.from_deepspeed(ds(zero)), field) == value


def test_bf16_spellings():
    assert Config.from_deepspeed(ds(bfloat16={"enabled": True})).compute_dtype == "bf16"
    assert Config.from_deepspeed(ds(bf16={"enabled": False})).compute_dtype == "fp32"


@pytest.mark.parametrize("config,key", [
    (ds(train_batch_sise=8), "train_batch_sise"),
    (ds({"stage3_prefetch_bucket_sise": 1}), "stage3_prefetch_bucket_sise"),
])
def test_unknown_keys_error_naming_them(config, key):
    with pytest.raises(ValueError, match=key):
        Config.from_deepspeed(config)


def test_known_unused_keys_warn_once_naming_them():
    config = ds({"sub_group_size": 1e9, "offload_param": {"device": "none"}},
                train_micro_batch_size_per_gpu=4, steps_per_print=10, fp16={"enabled": False})
    with pytest.warns(UserWarning) as record:
        got = Config.from_deepspeed(config)
    assert got == Config(gradient_clipping=1.0) and len(record) == 1
    message = str(record[0].message)
    for key in ("train_micro_batch_size_per_gpu", "steps_per_print", "fp16",
                "zero_optimization.sub_group_size", "zero_optimization.offload_param"):
        assert key in message


@pytest.mark.parametrize("config,key", [
    (ds({"offload_param": {"device": "cpu"}}), "offload_param"),
    (ds({"offload_optimizer": {"device": "nvme"}}), "offload_optimizer"),
    (ds({"zero_quantized_weights": True}), "zero_quantized_weights"),
    (ds({"zero_hpz_partition_size": 8}), "zero_hpz_partition_size"),
    (ds(fp16={"enabled": True}), "fp16"),
    (ds(amp={"enabled": True}), "amp"),
    ({"zero_optimization": {"stage": 2}}, "stage"),
    ({"zero_optimization": {}}, "stage"),
])
def test_lacking_features_error_naming_them(config, key):
    with pytest.raises(ValueError, match=key):
        Config.from_deepspeed(config)


@pytest.mark.parametrize("config,key", [
    (ds(gradient_accumulation_steps="auto"), "gradient_accumulation_steps"),
    (ds({"stage3_prefetch_bucket_size": "auto"}), "zero_optimization.stage3_prefetch_bucket_size"),
    (ds(train_micro_batch_size_per_gpu="auto"), "train_micro_batch_size_per_gpu"),
])
def test_auto_values_error(config, key):
    with pytest.raises(ValueError, match=key):
        Config.from_deepspeed(config)


@pytest.mark.parametrize("config,error,key", [
    (ds({"stage3_max_live_parameters": 1.5e0}), TypeError, "stage3_max_live_parameters"),
    (ds({"reduce_bucket_size": "5e8"}), TypeError, "reduce_bucket_size"),
    (ds(gradient_accumulation_steps=2.5), TypeError, "gradient_accumulation_steps"),
    (ds(gradient_clipping=-1), ValueError, "gradient_clipping"),
    (ds({"stage3_max_reuse_distance": -1}), ValueError, "max_reuse_distance"),
])
def test_bad_values(config, error, key):
    with pytest.raises(error, match=key):
        Config.from_deepspeed(config)


def test_shape_errors():
    with pytest.raises(ValueError, match="zero_optimization"):
        Config.from_deepspeed({"train_batch_size": 8})
    with pytest.raises(TypeError):
        Config.from_deepspeed([("zero_optimization", ZERO3)])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="zero_optimization"):
        Config.from_deepspeed({"zero_optimization": 3})
