"""Config validation and Config.from_deepspeed (fz3/config/config.py, fz3/config/deepspeed_keys.py)."""
from __future__ import annotations

import dataclasses
import re
import warnings

import pytest

from fz3.config.config import Config

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
    # DeepSpeed 0.19.8 at stage 3 takes both false and reduce-scatters each grad (stage3.py)
    assert c.replace(reduce_scatter=False, contiguous_gradients=False).reduce_path == "reduce_scatter"


INVALID = [
    (dict(prefetch_bucket_size=-1), ValueError),
    (dict(max_live_parameters=1.5), TypeError),
    (dict(max_reuse_distance=True), TypeError),
    (dict(param_persistence_threshold=5e7), TypeError),  # Config wants ints; from_deepspeed converts
    (dict(reduce_bucket_size=0), ValueError),
    (dict(gradient_accumulation_steps=0), ValueError),
    (dict(contiguous_gradients=1), TypeError),
    (dict(gradient_clipping=-1.0), ValueError),
    (dict(gradient_clipping=True), ValueError),
    (dict(gradient_clipping=float("nan")), ValueError),
    (dict(compute_dtype="fp8"), ValueError),
    (dict(hysteresis=0, compute_dtype="fp16"), ValueError),
    (dict(loss_scale=float("inf"), compute_dtype="fp16"), ValueError),
    (dict(loss_scale_window=1.5), TypeError),
]


@pytest.mark.parametrize("fields,error", INVALID, ids=[str(f) for f, _ in INVALID])
def test_invalid_fields(fields, error):
    with pytest.raises(error, match=rf"\b{next(iter(fields))}\b"):  # names the field, as a word
        Config(**fields)


OPTIONS_INVALID = [
    (dict(debug_checks="yes"), TypeError),
    (dict(gloo_reduce_scatter=True), ValueError),
    (dict(gloo_all_gather="ring"), ValueError),
]


@pytest.mark.parametrize("fields,error", OPTIONS_INVALID, ids=[str(f) for f, _ in OPTIONS_INVALID])
def test_invalid_options(fields, error):
    from fz3 import Options
    with pytest.raises(error, match=next(iter(fields))):
        Options(**fields)


def test_options_argument_must_be_options():
    from fz3.config.options import Options, given
    assert given(None, "fz3.plan") == Options()
    with pytest.raises(TypeError, match="fz3.plan: options must be a fz3.Options, got str"):
        given("p2p", "fz3.plan")


def test_fz3_own_switches_are_not_config_fields():
    """DeepSpeed's vocabulary stays clean: the gloo carriers and the debug mode are fz3.Options."""
    for name in ("gloo_all_gather", "gloo_reduce_scatter", "debug_checks"):
        with pytest.raises(TypeError, match=name):
            Config(**{name: None})


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
    for key in ("train_micro_batch_size_per_gpu", "steps_per_print", "fp16"):
        assert key in message
    assert "sub_group_size" not in message and "offload_param" not in message  # Config fields now


@pytest.mark.parametrize("config,key", [
    (ds({"offload_param": {"device": "gpu"}}), "offload_param"),
    (ds({"offload_optimizer": {"device": "nvme"}}), "offload_optimizer"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, "offload_param"),
    (ds({"zero_quantized_weights": True}), "zero_quantized_weights"),
    (ds(amp={"enabled": True}), "amp"),
    (ds(gradient_allreduce_op="sum"), "gradient_allreduce_op"),
])
def test_lacking_features_error_naming_them(config, key):
    with pytest.raises(ValueError, match=key):
        Config.from_deepspeed(config)


@pytest.mark.parametrize("config,key", [
    (ds(gradient_accumulation_steps="auto"), "gradient_accumulation_steps"),
    (ds(train_micro_batch_size_per_gpu="auto"), "train_micro_batch_size_per_gpu"),
])
def test_auto_values_deepspeed_fails_on_error(config, key):
    """[Note: "auto"]: a top-level number DeepSpeed 0.19.8 keeps as the string "auto" and fails on."""
    with pytest.raises(ValueError, match=key):
        Config.from_deepspeed(config)


def test_auto_in_a_section_keeps_deepspeeds_default():
    """[Note: "auto"]: DeepSpeed's pydantic sections drop an "auto" (bf16 "auto" is off)."""
    got = Config.from_deepspeed(ds({"stage3_prefetch_bucket_size": "auto", "reduce_bucket_size": "auto"},
                                   bf16={"enabled": "auto"}, fp16={"enabled": "auto"}))
    assert (got.prefetch_bucket_size, got.reduce_bucket_size, got.compute_dtype) == \
        (Config().prefetch_bucket_size, Config().reduce_bucket_size, "fp32")


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
    with pytest.raises(TypeError):
        Config.from_deepspeed([("zero_optimization", ZERO3)])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="zero_optimization"):
        Config.from_deepspeed({"zero_optimization": 3})


# ---- keys that change DeepSpeed's training: translated, or rejected naming key and value ------

def test_new_defaults_are_deepspeeds():
    import sys

    from fz3.config.config import DEFAULT_LEAF_MODULE_CLASSES
    c = Config()
    assert (c.communication_data_type, c.prescale_gradients, c.gradient_predivide_factor) == (
        None, False, 1.0)
    assert c.model_persistence_threshold == sys.maxsize
    assert c.leaf_module_classes == DEFAULT_LEAF_MODULE_CLASSES  # DeepSpeed 0.19's HF MoE blocks
    assert (c.leaf_module_names, c.leaf_module_name_suffixes) == ((), ())


NEW_INVALID = [
    (dict(communication_data_type="fp64"), ValueError),
    (dict(communication_data_type="FP32"), ValueError),  # from_deepspeed lowercases; Config is exact
    (dict(prescale_gradients=1), TypeError),
    (dict(gradient_predivide_factor=0), ValueError),
    (dict(gradient_predivide_factor=-2.0), ValueError),
    (dict(gradient_predivide_factor=float("inf")), ValueError),
    (dict(gradient_predivide_factor=True), ValueError),
    (dict(model_persistence_threshold=-1), ValueError),
    (dict(leaf_module_classes="Block"), TypeError),  # a bare string is not a list of names
    (dict(leaf_module_names=[1]), TypeError),
    (dict(leaf_module_name_suffixes=("",)), TypeError),
]


@pytest.mark.parametrize("fields,error", NEW_INVALID, ids=[str(f) for f, _ in NEW_INVALID])
def test_new_invalid_fields_name_field_and_value(fields, error):
    (name, value), = fields.items()
    with pytest.raises(error, match=name) as err:
        Config(**fields)
    assert repr(value) in str(err.value)


def test_leaf_lists_become_tuples_and_config_hashes():
    c = Config(leaf_module_classes=["Block"], leaf_module_names=["h.0", "h.1"])
    assert c.leaf_module_classes == ("Block",) and c.leaf_module_names == ("h.0", "h.1")
    assert hash(c) == hash(Config(leaf_module_classes=("Block",), leaf_module_names=("h.0", "h.1")))


TRANSLATED = [  # DeepSpeed dict -> the Config fields it sets (the rest at their defaults)
    (ds(communication_data_type="fp32"), dict(communication_data_type="fp32")),
    (ds(communication_data_type="BF16"), dict(communication_data_type="bf16")),  # DeepSpeed lowercases
    (ds(communication_data_type="fp16"), dict(communication_data_type="fp16")),
    (ds(communication_data_type=None), dict(communication_data_type=None)),
    (ds(prescale_gradients=True), dict(prescale_gradients=True)),
    (ds(prescale_gradients=False, gradient_predivide_factor=8), dict(gradient_predivide_factor=8)),
    (ds({"stage3_model_persistence_threshold": 1e5}), dict(model_persistence_threshold=100_000)),
    (ds({"model_persistence_threshold": 7}), dict(model_persistence_threshold=7)),  # the alias
    (ds({"leaf_module": {"classes": ["Block", "Block"], "names": "h.0", "name_suffixes": ["mlp"]}}),
     dict(leaf_module_classes=("Block",), leaf_module_names=("h.0",),
          leaf_module_name_suffixes=("mlp",))),  # a string is a list of one, duplicates drop
    (ds({"leaf_module": {"classes": []}}), dict(leaf_module_classes=())),  # the default replaced
    (ds({"leaf_module": {"names": ["moe"]}}), dict(leaf_module_names=("moe",))),  # classes: default
    (ds({"leaf_module": {}}), {}),
    # check_grad_overflow: stage 3 checks overflow in fp16 only; immediate_grad_update: bf16
    # optimizer of stage 0/1 only
    (ds(bf16={"enabled": True, "check_grad_overflow": True, "immediate_grad_update": True}),
     dict(compute_dtype="bf16")),
]


@pytest.mark.parametrize("config,fields", TRANSLATED, ids=[str(f) for _, f in TRANSLATED])
def test_translated(config, fields):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a translated key is not "accepted but unused"
        assert Config.from_deepspeed(config) == Config(gradient_clipping=1.0, **fields)


REJECTED = [  # DeepSpeed dict, the key the message must name, the value it must show
    (ds(optimizer={"type": "AdamW", "params": {"lr": 1e-3}}), "optimizer", "AdamW"),
    (ds(scheduler={"type": "WarmupLR"}), "scheduler", "WarmupLR"),
    (ds(torch_autocast={"enabled": True, "dtype": "bfloat16"}), "torch_autocast", "True"),
    (ds(checkpoint={"load_universal": True}), "checkpoint", "load_universal"),
    (ds(checkpoint={"use_node_local_storage": True}), "checkpoint", "use_node_local_storage"),
    (ds(autotuning={"enabled": True}), "autotuning", "True"),
    (ds(data_efficiency={"enabled": True}), "data_efficiency", "True"),
    (ds(hybrid_engine={"enabled": True}), "hybrid_engine", "True"),
    (ds(compile={"deepcompile": True}), "compile", "deepcompile"),
    (ds(weight_quantization={"quantized_initialization": {"num_bits": 8}}), "weight_quantization",
     "num_bits"),
    (ds(bf16={"enabled": True, "bf16_master_weights_and_grads": True}),
     "bf16.bf16_master_weights_and_grads", "True"),
    (ds(bf16={"enabled": True, "bf16_optimizer_states": True}), "bf16.bf16_optimizer_states", "True"),
    (ds(data_types={"grad_accum_dtype": "bf16"}), "data_types.grad_accum_dtype", "'bf16'"),
    (ds(data_types={"param_dtype": "fp32"}, bf16={"enabled": True}), "data_types.param_dtype", "'fp32'"),
    (ds(data_types={"buffer_dtype": "bf16"}), "data_types.buffer_dtype", "'bf16'"),
    (ds(data_types={"grad_dtype": "fp32"}), "grad_dtype", "grad_accum_dtype"),
    (ds(communication_data_type="fp64"), "communication_data_type", "'fp64'"),
    (ds(gradient_predivide_factor=0.0), "gradient_predivide_factor", "0.0"),
    (ds(prescale_gradients="yes"), "prescale_gradients", "'yes'"),
    (ds({"stage3_model_persistence_threshold": -1}), "model_persistence_threshold", "-1"),
    (ds({"load_from_fp32_weights": False}), "zero_optimization.load_from_fp32_weights", "False"),
    (ds({"pipeline_loading_checkpoint": True}), "zero_optimization.pipeline_loading_checkpoint", "True"),
    (ds({"stage3_module_granularity_threshold": -1}), "module_granularity_threshold", "-1"),
    (ds({"module_granularity_threshold": "big"}), "module_granularity_threshold", "'big'"),  # DeepSpeed's field name
    (ds({"leaf_module": {"class": ["Block"]}}), "leaf_module", "'class'"),
    (ds({"leaf_module": ["Block"]}), "leaf_module", "Block"),
    (ds(train_batch_size=32, train_micro_batch_size_per_gpu=4), "gradient_accumulation_steps", "32"),
]


@pytest.mark.parametrize("config,key,value", REJECTED, ids=[k for _, k, _ in REJECTED])
def test_rejected_naming_key_and_value(config, key, value):
    with pytest.raises((ValueError, TypeError)) as err:
        Config.from_deepspeed(config)
    message = str(err.value)
    assert key in message and value in message, message


ACCEPTED = [  # keys that change nothing in fz3 (or are switched off): accepted and reported
    ("gradient_allreduce_op", "mean"),  # DeepSpeed's default: fz3 averages
    ("disable_allgather", True),
    ("log_level", "info"),
    ("wandb", {"enabled": True}),
    ("comms_logger", {"enabled": True}),
    ("activation_checkpointing", {"partition_activations": True}),
    ("dataloader_drop_last", True),
    ("use_data_before_expert_parallelism", True),
    ("checkpoint", {"tag_validation": "Fail"}),
    ("data_types", {"grad_accum_dtype": "fp32", "param_dtype": None}),
    ("compile", {"deepcompile": False}),
    ("optimizer", None),
    ("torch_autocast", {"enabled": False}),
]
ZERO_ACCEPTED = [
    ("stage3_gather_16bit_weights_on_model_save", True), ("gather_16bit_weights_on_model_save", True),
    ("stage3_gather_fp16_weights_on_model_save", True), 
    ("memory_efficient_linear", False), ("stage3_use_all_reduce_for_fetch_params", True),
    ("allgather_sequential", True), ("cpu_offload_use_pin_memory", True),
    ("load_from_fp32_weights", True),
]


@pytest.mark.parametrize("key,value", ACCEPTED + [(f"zero_optimization.{k}", v) for k, v in ZERO_ACCEPTED],
                         ids=[k for k, _ in ACCEPTED] + [k for k, _ in ZERO_ACCEPTED])
def test_accepted_and_reported(key, value):
    config = ds({key.split(".")[1]: value}) if key.startswith("zero_optimization.") else ds(**{key: value})
    with pytest.warns(UserWarning) as record:
        got = Config.from_deepspeed(config)
    assert got == Config(gradient_clipping=1.0)
    assert key in str(record[0].message)


@pytest.mark.parametrize("key", ["gradient_accumulation_dtype", "monitor_config",
                                 "use_data_before_expert_parallel_"])
def test_names_deepspeed_does_not_read_are_unknown(key):
    """Not DeepSpeed 0.19 JSON keys (an attribute name, a mis-transcription): DeepSpeed would drop
    them silently, so they are reported as possible typos."""
    with pytest.raises(ValueError, match=f"unknown DeepSpeed config key '{key}'"):
        Config.from_deepspeed(ds(**{key: True}))


def test_every_table_key_is_handled():
    """Each key of the tables is accepted with some value (none falls through as unknown)."""
    from fz3.config import deepspeed_keys as keys
    off = {"load_from_fp32_weights": True}
    for key in sorted(keys.TOP_UNUSED) + sorted(keys.TOP_LACKING):
        with pytest.warns(UserWarning, match=key):
            Config.from_deepspeed(ds(**{key: off.get(key)}))
    for key in sorted(keys.ZERO_UNUSED) + sorted(keys.ZERO_LACKING) + sorted(keys.ZERO_ALIASES):
        value = off.get(key)
        if keys.ZERO_ALIASES.get(key, key) in keys.ZERO_FIELDS or key.endswith("module_granularity_threshold"):
            continue  # translated: test_translated, test_the_granularity_threshold_is_stage_3s
        with pytest.warns(UserWarning, match=key):
            Config.from_deepspeed(ds({key: value}))


def test_the_granularity_threshold_is_stage_3s():
    """stage3_module_granularity_threshold (or its field name) sets Config.module_granularity_threshold
    at stage 3; DeepSpeed's stages 0-2 never read it: ignored there, and reported."""
    for key in ("stage3_module_granularity_threshold", "module_granularity_threshold"):
        assert Config.from_deepspeed(ds({key: 2e3})).module_granularity_threshold == 2000
    with pytest.warns(UserWarning, match="stage3_module_granularity_threshold"):
        got = Config.from_deepspeed({"zero_optimization": {"stage": 2, "stage3_module_granularity_threshold": 100}})
    assert got.module_granularity_threshold == 0
    with pytest.raises(ValueError, match=r"module_granularity_threshold=100 .* at stage 1 .* use stage 3"):
        Config(stage=1, module_granularity_threshold=100)


# ---- defaults, predicates and messages of the translation (mutation testing, fz3/core) ---------

def test_zero_optimization_without_stage_is_stage_0():
    """DeepSpeed's stage default is 0, with or without the section."""
    assert Config.from_deepspeed({"zero_optimization": {}}).stage == 0
    with pytest.warns(UserWarning, match="train_batch_size"):
        assert Config.from_deepspeed({"train_batch_size": 8}).stage == 0


def test_not_a_dict_names_the_type_given():
    with pytest.raises(TypeError, match=r"from_deepspeed expects a dict \(DeepSpeed JSON config\), got list"):
        Config.from_deepspeed([("zero_optimization", ZERO3)])  # type: ignore[arg-type]


def test_unknown_key_message_lists_the_translated_keys():
    with pytest.raises(ValueError, match="fz3 knows zero_optimization, bf16, gradient_accumulation_steps, "
                                         "gradient_clipping, communication_data_type, prescale_gradients, "
                                         "gradient_predivide_factor, managed_gradient_accumulation and"):
        Config.from_deepspeed(ds(train_batch_sise=8))


@pytest.mark.parametrize("key,section", [("fp16", {"loss_scale": 0}), ("bf16", {"immediate_grad_update": True}),
                                         ("torch_autocast", {"dtype": "bfloat16"})])
def test_section_without_enabled_is_off(key, section):
    """DeepSpeed's `enabled` defaults to False: a section that does not say is switched off."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 / torch_autocast: accepted and reported
        assert Config.from_deepspeed(ds(**{key: section})) == Config(gradient_clipping=1.0)


def test_truthy_non_dict_section_is_on():
    """A section given as a bare value rather than a dict counts as switched on when truthy;
    fp16, whose section carries its loss scale, must be a dict."""
    with pytest.raises(TypeError, match=r"fp16 must be a dict such as \{'enabled': true, 'loss_scale': 0\}, got True"):
        Config.from_deepspeed(ds(fp16=True))
    assert Config.from_deepspeed(ds(bf16=True)).compute_dtype == "bf16"


@pytest.mark.parametrize("key,value", [("nebula", {"enabled": False}), ("amp", {"enabled": False}),
                                       ("elasticity", {"enabled": False}), ("sparse_gradients", False),
                                       ("compression_training", {}), ("zero_optimization.mics_shard_size", -1),
                                       ("zero_optimization.zeropp_loco_param", None)])
def test_keys_deepspeed_0_19_8_removed_are_refused_whatever_their_value(key, value):
    """DeepSpeed 0.19.8 refuses a removed feature's key even switched off (runtime/config.py
    _reject_removed_config_keys), so a config that carries one does not run there either."""
    config = ds({key.split(".")[1]: value}) if key.startswith("zero_optimization.") else ds(**{key: value})
    with pytest.raises(ValueError, match=f"{key.split('.')[-1]}.*DeepSpeed 0.19.8 refuses it whatever its value"):
        Config.from_deepspeed(config)

def test_any_true_predicate():
    """checkpoint / compile: on when one of the named sub-keys is truthy; a non-dict is off.
    Called here, not only through TOP_LACKING: the table builds its lambdas at import time."""
    from fz3.config.deepspeed_keys import _any_true
    on = _any_true("load_universal", "use_node_local_storage")
    assert on({"use_node_local_storage": 1}) is True
    assert on({"load_universal": False, "tag_validation": "Fail"}) is False
    assert on({}) is False
    assert on(True) is False


@pytest.mark.parametrize("key", ["offload_param", "offload_optimizer"])
def test_offload_section_without_device_is_off(key):
    """DeepSpeed's offload device defaults to "none"."""
    got = Config.from_deepspeed(ds({key: {"pin_memory": True}}))
    assert got == Config(gradient_clipping=1.0) and not getattr(got, key).on


def test_offload_given_as_a_non_dict_is_refused_naming_it():
    with pytest.raises(TypeError, match="offload_param must be a dict of DeepSpeed's keys"):
        Config.from_deepspeed(ds({"offload_param": True}))


def test_the_old_offload_booleans_turn_on_cpu_offload():
    """DeepSpeed's deprecated cpu_offload / cpu_offload_param: {"device": "cpu"} when true."""
    got = Config.from_deepspeed(ds({"cpu_offload": True, "cpu_offload_param": True}))
    assert got.offload_optimizer.device == "cpu" and got.offload_param.device == "cpu"


@pytest.mark.parametrize("names", [{"h.0"}, ["h.0", 1]], ids=["set", "non-string entry"])
def test_leaf_module_entries_must_be_a_list_of_strings(names):
    with pytest.raises(TypeError, match=r"zero_optimization\.leaf_module\.names must be a list of strings, "
                                        r"got " + re.escape(repr(names))):
        Config.from_deepspeed(ds({"leaf_module": {"names": names}}))


def test_data_types_must_be_a_dict():
    with pytest.raises(TypeError, match=r"data_types must be a dict, got \['fp32'\]"):
        Config.from_deepspeed(ds(data_types=["fp32"]))


def test_both_batch_sizes_with_accumulation_steps_are_accepted():
    """Only the two batch sizes without gradient_accumulation_steps are rejected."""
    with pytest.warns(UserWarning, match="train_batch_size"):
        got = Config.from_deepspeed(ds(train_batch_size=32, train_micro_batch_size_per_gpu=4,
                                       gradient_accumulation_steps=8))
    assert got == Config(gradient_clipping=1.0, gradient_accumulation_steps=8)


def test_unused_keys_warning_lists_them_comma_separated():
    with pytest.warns(UserWarning) as record:
        Config.from_deepspeed(ds({"memory_efficient_linear": False}, steps_per_print=10, wandb={"enabled": True}))
    listed = str(record[0].message).split(": ", 1)[1]
    assert listed.split(", ") == ["zero_optimization.memory_efficient_linear", "steps_per_print", "wandb"]


def test_unused_keys_warning_points_at_the_caller(monkeypatch):
    """stacklevel: the warning is attributed to the line that called from_deepspeed, not to fz3.
    The caller is read at the warn call, so a wrapper around from_deepspeed (mutmut's
    trampoline) counts as the caller."""
    import sys
    import types

    import fz3.config.config as config_module
    callers = []

    def warn(message, category=None, stacklevel=1):
        caller = sys._getframe(2)  # 0: this shim, 1: from_deepspeed, 2: its caller
        callers.append((caller.f_code.co_filename, caller.f_lineno))
        warnings.warn(message, category, stacklevel=stacklevel + 1)

    monkeypatch.setattr(config_module, "warnings", types.SimpleNamespace(warn=warn))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        Config.from_deepspeed(ds(steps_per_print=10))
    (w,) = record
    assert [(w.filename, w.lineno)] == callers
    if not hasattr(Config.from_deepspeed, "__wrapped__"):  # called directly from this file
        assert w.filename == __file__


def test_differences_are_the_fields_off_deepspeeds_defaults():
    """config.differences (printed by fz3.shell.log and fz3.observe.plan), in field order."""
    from fz3.config.config import differences
    assert differences(Config()) == {}
    got = differences(Config(compute_dtype="bf16", prefetch_bucket_size=0, leaf_module_names=["h.0"]))
    assert list(got.items()) == [("prefetch_bucket_size", 0), ("compute_dtype", "bf16"),
                                 ("leaf_module_names", ("h.0",))]


@pytest.mark.parametrize("value", [True, False])
def test_managed_gradient_accumulation_is_read(value):
    """DeepSpeed's top-level key: False makes every step() the accumulation boundary ([Note: the
    window closes at step()], fz3/core/grad/epilogue.py)."""
    assert Config.from_deepspeed(ds(managed_gradient_accumulation=value)).managed_gradient_accumulation is value
    with pytest.raises(TypeError, match="managed_gradient_accumulation must be a bool, got 'no'"):
        Config.from_deepspeed(ds(managed_gradient_accumulation="no"))
