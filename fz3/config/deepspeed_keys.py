"""Translate a DeepSpeed JSON config dict into fz3 Config fields.

Tables, not logic: which DeepSpeed keys map to which Config field; which are known but change
nothing in fz3 (accepted and reported, each with the reason); which turn on behaviour fz3 does
not implement (an error naming the key, its value and what to do instead, only when switched
on). Key names, defaults and semantics follow DeepSpeed 0.19 (read at 0.19.6:
`deepspeed/runtime/config.py`, `runtime/constants.py`, `runtime/zero/config.py`,
`runtime/zero/leaf_module_config.py`, `runtime/engine.py`, `runtime/zero/stage3.py`).

    key in *_FIELDS      -> a Config field (Config validates the value, naming it)
    key in *_LACKING     -> error if its predicate says the feature is on, else reported
    key in *_UNUSED      -> reported (one warning from Config.from_deepspeed)
    anything else        -> error: unknown key (misspelt?)
"""
from __future__ import annotations

from typing import Callable, Mapping

# top-level key -> Config field
TOP_FIELDS = {
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "gradient_clipping",
    "communication_data_type": "communication_data_type",  # DeepSpeed lowercases it; None = default
    "prescale_gradients": "prescale_gradients",
    "gradient_predivide_factor": "gradient_predivide_factor",
    "managed_gradient_accumulation": "managed_gradient_accumulation",
}
# zero_optimization key -> Config field
ZERO_FIELDS = {
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_max_live_parameters": "max_live_parameters",
    "stage3_max_reuse_distance": "max_reuse_distance",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "stage3_model_persistence_threshold": "model_persistence_threshold",
    "reduce_bucket_size": "reduce_bucket_size",
    "contiguous_gradients": "contiguous_gradients",
    "reduce_scatter": "reduce_scatter",
    "overlap_comm": "overlap_comm",
    "sub_group_size": "sub_group_size",
}
# zero_optimization sections -> the Config field that takes them as dicts (fz3/config/offload.py);
# and the old boolean spellings -> the section they turn on
ZERO_SECTIONS = ("offload_optimizer", "offload_param")
ZERO_OLD_OFFLOAD = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}
# DeepSpeed's other spellings (pydantic field name vs `alias=`, deprecated names) -> the key
# the tables below use
ZERO_ALIASES = {
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "model_persistence_threshold": "stage3_model_persistence_threshold",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "module_granularity_threshold": "stage3_module_granularity_threshold",
    "use_all_reduce_for_fetch_params": "stage3_use_all_reduce_for_fetch_params",
    "allgather_sequential": "stage3_allgather_sequential",
}
DEEPSPEED_GRADIENT_CLIPPING = 1.0  # DeepSpeed 0.19's default when the key is absent
INT_FIELDS = {"prefetch_bucket_size", "max_live_parameters", "max_reuse_distance",
              "param_persistence_threshold", "model_persistence_threshold", "reduce_bucket_size",
              "gradient_accumulation_steps", "sub_group_size"}
# zero_optimization.leaf_module sub-key -> Config field (DeepSpeedZeroLeafModuleConfig)
LEAF_KEYS = {"classes": "leaf_module_classes", "names": "leaf_module_names",
             "name_suffixes": "leaf_module_name_suffixes"}


def _enabled(section: object) -> bool:
    """`enabled` of a section; "auto" there is DeepSpeed's default, off ([Note: "auto"])."""
    if isinstance(section, Mapping):
        enabled = section.get("enabled", False)
        return not is_auto(enabled) and bool(enabled)
    return bool(section)


def _any_true(*keys: str) -> Callable[[object], bool]:
    return lambda section: isinstance(section, Mapping) and any(bool(section.get(k)) for k in keys)


_FP32_ONLY = "fz3 keeps fp32 master weights, grad partitions and optimizer states"

# top-level features fz3 lacks: key -> (predicate "switched on", what to do instead)
TOP_LACKING: dict[str, tuple[Callable[[object], bool], str]] = {
    "optimizer": (lambda v: v is not None, "fz3 builds no optimizer from the JSON: build it "
                  "yourself (e.g. torch.optim.AdamW(model.parameters(), lr=...)) and pass it to "
                  "fz3.initialize"),
    "scheduler": (lambda v: v is not None, "fz3 builds no LR scheduler from the JSON: build it on "
                  "your optimizer and pass it as fz3.initialize(..., lr_scheduler=...)"),
    "torch_autocast": (_enabled, "fz3 computes in one dtype (bf16.enabled, with fp32 master "
                       "shards) and has no autocast mode: use bf16 or fp32"),
    "checkpoint": (_any_true("load_universal", "use_node_local_storage"),
                   "fz3 saves and loads its own sharded checkpoints (engine.save_checkpoint / "
                   "load_checkpoint, any world size): remove load_universal / use_node_local_storage"),
    "autotuning": (_enabled, "fz3 has no autotuner: set the zero_optimization sizes yourself"),
    # DeepSpeed 0.19.8: "mean" (the default) or "sum", which sums the grads over ranks at stages
    # 0-2 (engine.py gradient_average) and is refused at stage 3
    "gradient_allreduce_op": (lambda v: v is not None and str(v).lower() != "mean", "fz3 averages the grads over the "
                              "ranks (DeepSpeed's 'mean', its default); 'sum' is not implemented: remove the key or "
                              "set 'mean'"),
    "data_efficiency": (_enabled, "fz3 runs no data sampling or random-LTD routing: disable it"),
    "hybrid_engine": (_enabled, "fz3 has no hybrid (generate + train) engine: disable it"),
    "compile": (_any_true("deepcompile", "passes"), "fz3 has no DeepCompile: remove deepcompile "
                "and passes"),
    "weight_quantization": (lambda v: bool(v), "fz3 does not quantize weights: remove it"),
}
# bf16 / bfloat16 sub-keys beyond `enabled` that change training (precision_config.py)
BF16_LACKING = {
    "bf16_master_weights_and_grads": _FP32_ONLY,
    "bf16_optimizer_states": _FP32_ONLY,
}
# fp16 sub-key -> Config field: the loss scale (DeepSpeedFP16Config; fz3/core/grad/scaler.py)
FP16_FIELDS = {"loss_scale": "loss_scale", "initial_scale_power": "initial_scale_power",
               "loss_scale_window": "loss_scale_window", "hysteresis": "hysteresis",
               "consecutive_hysteresis": "consecutive_hysteresis", "min_loss_scale": "min_loss_scale"}
FP16_UNUSED = {"auto_cast": "fz3 casts the forward's floating inputs to the compute dtype whatever it says"}
FP16_LACKING = {"fp16_master_weights_and_grads": _FP32_ONLY}
# data_types (DeepSpeed 0.19 runtime/config.py; DtypeEnum spellings): what fz3 does is fixed
DTYPE_NAMES = {"fp32": ("fp32", "float32", "float", "torch.float32"),
               "bf16": ("bf16", "bfloat16", "torch.bfloat16"),
               "fp16": ("fp16", "float16", "half", "torch.float16")}

# zero_optimization features fz3 lacks: key -> (predicate "switched on", what to do instead)
ZERO_LACKING: dict[str, tuple[Callable[[object], bool], str]] = {
    "zero_quantized_weights": (bool, "fz3 gathers weights unquantized: set false"),
    "zero_quantized_nontrainable_weights": (bool, "fz3 keeps weights unquantized: set false"),
    "zero_quantized_gradients": (bool, "fz3 reduces grads unquantized (communication_data_type "
                                 "picks their dtype): set false"),
    "zenflow": (lambda v: v is not None, "fz3 has no ZenFlow: remove it"),
    "load_from_fp32_weights": (lambda v: not v, "fz3 always loads the fp32 master weights from its "
                               "checkpoints: remove the key"),
    "pipeline_loading_checkpoint": (bool, "fz3 has no pipeline checkpoints: set false"),
}

# Keys DeepSpeed 0.19.8 itself refuses wherever they appear, whatever their value: the feature
# was removed (runtime/config.py _REMOVED_TOP_LEVEL_CONFIG_KEYS, _REMOVED_ZERO_CONFIG_KEYS,
# _reject_removed_config_keys; deepspeedai/DeepSpeed#8489). key -> what DeepSpeed says
REMOVED_TOP = {
    "nebula": "Nebula checkpointing has been removed",
    "compression_training": "The DeepSpeed compression library has been removed",
    "amp": "NVIDIA Apex AMP integration has been removed. Use DeepSpeed 'fp16', 'bf16', or 'torch_autocast' instead",
    "quantize_training": "Mixture-of-Quantization (MoQ) / 'quantize_training' has been removed",
    "sparse_gradients": "Sparse compression of dense torch.nn.Embedding gradients has been removed",
    "eigenvalue": "Eigenvalue-based Mixture-of-Quantization (MoQ) has been removed",
    "sparse_attention": "DeepSpeed Sparse Attention has been removed",
    "elasticity": "Elastic training has been removed; set train_batch_size / train_micro_batch_size_per_gpu / "
                  "gradient_accumulation_steps directly",
    "graph_harvesting": "Graph harvesting has been removed",
    "curriculum_learning": "Legacy top-level 'curriculum_learning' has been removed. Use "
                           "'data_efficiency.data_sampling.curriculum_learning' instead",
    "progressive_layer_drop": "Progressive Layer Dropping has been removed",
}
REMOVED_ZERO = {
    "mics_shard_size": "MiCS ZeRO-3 sharding has been removed",
    "mics_hierarchical_params_gather": "MiCS ZeRO-3 sharding has been removed",
    "zeropp_loco_param": "LoCo-Zero++ has been removed",
}


def _removed(key: str, table: Mapping[str, str], where: str = "") -> None:
    if key in table:
        raise ValueError(f"DeepSpeed key {where}{key!r}: DeepSpeed 0.19.8 refuses it whatever its value "
                         f"({table[key]}; deepspeedai/DeepSpeed#8489): remove it")


# DeepSpeed keys that change nothing in fz3: key -> why (shown to readers, not to users)
TOP_UNUSED = {
    "train_batch_size": "batch-size bookkeeping: fz3 never sees the batch (see _batch_sizes)",
    "train_micro_batch_size_per_gpu": "batch-size bookkeeping",
    "dataloader_drop_last": "only engine.deepspeed_io's dataloader; fz3 leaves data to you",
    "steps_per_print": "logging",
    "wall_clock_breakdown": "timing logs",
    "dump_state": "logging",
    "memory_breakdown": "logging",
    "log_level": "logging",
    "timers": "throughput logging",
    "flops_profiler": "profiling logs",
    "tensorboard": "monitoring", "wandb": "monitoring", "csv_monitor": "monitoring",
    "comet": "monitoring", "comms_logger": "logging",
    "zero_allow_untested_optimizer": "fz3 takes any torch optimizer",
    "zero_force_ds_cpu_optimizer": "whether DeepSpeed insists on its CPU Adam under offload: fz3 steps the user's "
                                   "optimizer on the offloaded shards, whatever it is",
    "activation_checkpointing": "configures deepspeed.checkpointing, which only user code calls",
    "pipeline": "PipelineModule only",
    "seq_parallel_communication_data_type": "sequence parallelism only",
    "use_data_before_expert_parallelism": "expert-parallel groups of deepspeed.moe only",
    "disable_allgather": "read but used nowhere in DeepSpeed 0.19",
}
ZERO_UNUSED = {
    "stage3_gather_16bit_weights_on_model_save": "only engine.save_16bit_model: fz3.deepspeed.initialize "
                                                 "reads it (fz3/deepspeed/settings.py)",
    "memory_efficient_linear": "a memory-saving F.linear with the same numbers",
    "override_module_apply": "deepspeed.zero.Init only",
    "stage3_use_all_reduce_for_fetch_params": "how a gather is carried; same values",
    "stage3_allgather_sequential": "how gathers are batched; same values",
    "log_trace_cache_warnings": "logging", "enable_sanity_checks": "debug checks",
    # stages 1/2 (runtime/zero/stage_1_and_2.py): how the same values move, or what fz3 does anyway
    "allgather_partitions": "all-gather or broadcasts for the updated params after the step: fz3 refreshes "
                            "them in one gather, the same values",
    "allgather_bucket_size": "bucket of that all-gather: fz3 refreshes the persistent params in one gather",
    "use_multi_rank_bucket_allreduce": "how a stage-1/2 bucket's reduce is split over ranks; same values",
    "round_robin_gradients": "the order of stage-1/2 grad partitions for CPU offload; same values",
    "ignore_unused_parameters": "fz3 never stops at an unused param: it is not stepped ([Note: no grad, no step])",
    "elastic_checkpoint": "DeepSpeed's stage-1/2 checkpoint layout: fz3 writes its own, loadable at any stage and "
                          "world size",
    "legacy_stage1": "DeepSpeed's old stage-1 code path; same values",
    "cpu_offload_use_pin_memory": "the old spelling of offload_*.pin_memory: fz3's host buffers are pinned where "
                                  "the device can use it (fz3/core/offload.py)",
    "save_muon_momentum_buffer_in_memory": "NVMe offload only",
}


def translate(ds: Mapping[str, object]) -> tuple[dict[str, object], list[str]]:
    """-> (Config keyword arguments, DeepSpeed keys accepted but unused)."""
    if not isinstance(ds, Mapping):
        raise TypeError(f"from_deepspeed expects a dict (DeepSpeed JSON config), got {type(ds).__name__}")
    # DeepSpeed 0.19 clips at 1.0 when the JSON says nothing (runtime/constants.py,
    # GRADIENT_CLIPPING_DEFAULT); a drop-in must train the same, so absent means 1.0 here.
    fields: dict[str, object] = {"gradient_clipping": DEEPSPEED_GRADIENT_CLIPPING}
    ignored: list[str] = []
    for key, value in ds.items():
        _removed(key, REMOVED_TOP)
        if is_auto(value):
            auto_means_default(key, None)  # top-level: refused
        if key == "zero_optimization":
            _zero(value, fields, ignored)
        elif key in ("bf16", "bfloat16"):
            _bf16(key, value, fields)
        elif key == "fp16":
            _fp16(value, fields, ignored)
        elif key in TOP_FIELDS:
            fields[TOP_FIELDS[key]] = _value(key, TOP_FIELDS[key], value)
        elif key == "data_types":
            ignored.append(key)  # checked below, once bf16 is known
        elif key == "aio":
            fields["aio"] = _section(key, value, ignored)
        elif key in TOP_LACKING:
            _lacking(key, value, TOP_LACKING[key])
            ignored.append(key)
        elif key in TOP_UNUSED:
            ignored.append(key)
        else:
            raise ValueError(f"unknown DeepSpeed config key {key!r} (misspelt?); fz3 knows "
                             f"zero_optimization, bf16, {', '.join(TOP_FIELDS)} and DeepSpeed "
                             f"0.19's other top-level keys")
    bf16 = any(_enabled(_without_auto(ds.get(k))) for k in ("bf16", "bfloat16"))
    if _enabled(_without_auto(ds.get("fp16"))) and bf16:
        raise ValueError("DeepSpeed keys 'fp16.enabled' and 'bf16.enabled' are both true: one compute dtype at a "
                         "time (DeepSpeed: 'bfloat16 and fp16 modes cannot be simultaneously enabled'); keep one")
    if "zero_optimization" not in ds:
        fields.update(stage=0, overlap_comm=False)  # DeepSpeed's default: no ZeRO, data parallel
    if fields.get("managed_gradient_accumulation") is False and fields["stage"] < 2 and fields.get("overlap_comm"):
        raise ValueError(f"managed_gradient_accumulation false with zero_optimization.overlap_comm true at stage "
                         f"{fields['stage']}: DeepSpeed 0.19.8 refuses it ('managed_gradient_accumulation=False "
                         "supports ZeRO overlap_comm only with ZeRO stage 2'); set overlap_comm false, or use stage 2 "
                         "or 3")
    _data_types(ds.get("data_types"), str(fields.get("compute_dtype", "fp32")))
    _batch_sizes(ds)
    return fields, ignored


def _zero(zero: object, fields: dict[str, object], ignored: list[str]) -> None:
    if not isinstance(zero, Mapping):
        raise TypeError(f"zero_optimization must be a dict, got {zero!r}")
    stage = zero.get("stage", 0)
    if is_auto(stage):
        stage = 0  # [Note: "auto"]: DeepSpeed's default
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_optimization.stage = {stage!r}: DeepSpeed's stages are 0, 1, 2 and 3 (DeepSpeed "
                         "0.19.8: 'Input should be 0, 1, 2, 3'): 0 data parallel, 1 partitions the optimizer state, "
                         "2 also the grads, 3 also the params")
    fields["stage"] = int(stage)
    if stage < 3:  # DeepSpeed's overlap_comm None (absent) is True at stage 3 only (zero/config.py)
        fields["overlap_comm"] = False
    for key, value in zero.items():
        _removed(key, REMOVED_ZERO, "zero_optimization.")
        if is_auto(value):  # [Note: "auto"]: the field keeps DeepSpeed's default
            continue
        canonical = ZERO_ALIASES.get(key, key)
        if key == "stage":
            continue
        if canonical in ZERO_FIELDS:
            field = ZERO_FIELDS[canonical]
            if value is None and field == "overlap_comm":  # DeepSpeed: None means True at stage 3
                value = stage == 3
            fields[field] = _as_int(key, value) if field in INT_FIELDS else value
        elif canonical == "stage3_module_granularity_threshold":  # read by stage 3's DeepSpeedZeRoOffload only
            if value is not None and stage == 3:
                fields["module_granularity_threshold"] = _as_int(key, value)
            elif value not in (None, 0):
                ignored.append(f"zero_optimization.{key}")
        elif key == "zero_hpz_partition_size":  # DeepSpeed's stages 0-2 never read it
            if value is not None and stage == 3:
                fields["zero_hpz_partition_size"] = _as_int(key, value)
            elif value not in (None, 1):
                ignored.append(f"zero_optimization.{key}")
        elif key == "leaf_module":
            fields.update(_leaf_module(value))
        elif key in ZERO_SECTIONS:
            if value is not None:
                fields[key] = _section(f"zero_optimization.{key}", value, ignored)
        elif key in ZERO_OLD_OFFLOAD:  # DeepSpeed's deprecated booleans: {"device": "cpu"} when true
            if value:
                fields.setdefault(ZERO_OLD_OFFLOAD[key], {"device": "cpu"})
        elif canonical in ZERO_LACKING:
            _lacking(f"zero_optimization.{key}", value, ZERO_LACKING[canonical])
            ignored.append(f"zero_optimization.{key}")
        elif canonical in ZERO_UNUSED:
            ignored.append(f"zero_optimization.{key}")
        else:
            raise ValueError(f"unknown zero_optimization key {key!r} (misspelt?); fz3 uses "
                             f"{sorted(ZERO_FIELDS)}, leaf_module and stage")


def _section(name: str, value: object, ignored: list[str]) -> object:
    """An offload or aio section for Config (fz3/config/offload.py checks its keys and values):
    "auto" values keep DeepSpeed's defaults ([Note: "auto"]); the keys that change nothing in
    fz3 are reported."""
    from fz3.config.offload import IGNORED
    if not isinstance(value, Mapping):
        return value  # Config says what it takes
    table = IGNORED["Aio" if name == "aio" else "OffloadParam" if name.endswith("offload_param") else "OffloadOptimizer"]
    ignored.extend(f"{name}.{k}" for k in value if k in table)
    return {k: v for k, v in value.items() if not is_auto(v)}


def _value(key: str, field: str, value: object) -> object:
    if field in INT_FIELDS:
        return _as_int(key, value)
    if field == "communication_data_type" and isinstance(value, str):
        return value.lower()  # DeepSpeed: get_communication_data_type lowercases
    return value


def _lacking(key: str, value: object, entry: tuple[Callable[[object], bool], str]) -> None:
    on, advice = entry
    if on(value):
        raise ValueError(f"DeepSpeed key {key!r} = {value!r} turns on what fz3 does not "
                         f"implement: {advice}")


def _bf16(key: str, value: object, fields: dict[str, object]) -> None:
    """bf16.enabled -> compute_dtype; the sub-keys that would change the master dtype raise.
    An "auto" sub-key keeps DeepSpeed's default ([Note: "auto"]): enabled "auto" is off."""
    if isinstance(value, Mapping):
        value = {k: v for k, v in value.items() if not is_auto(v)}
    if _enabled(value):
        fields["compute_dtype"] = "bf16"
    if isinstance(value, Mapping):
        for sub, advice in BF16_LACKING.items():
            if value.get(sub):
                raise ValueError(f"DeepSpeed key '{key}.{sub}' = {value[sub]!r}: {advice}; "
                                 "remove it")


def _without_auto(section: object) -> object:
    return {k: v for k, v in section.items() if not is_auto(v)} if isinstance(section, Mapping) else section


def _fp16(value: object, fields: dict[str, object], ignored: list[str]) -> None:
    """fp16.enabled -> compute_dtype fp16 and its loss scale's fields; an "auto" sub-key keeps
    DeepSpeed's default ([Note: "auto"]), so enabled "auto" is off. The sub-keys are read only
    when it is on, as DeepSpeed validates them only then."""
    if value is None:
        return
    if not isinstance(value, Mapping):
        raise TypeError(f"fp16 must be a dict such as {{'enabled': true, 'loss_scale': 0}}, got {value!r}")
    value = _without_auto(value)
    for sub in value:
        if sub not in FP16_FIELDS and sub not in FP16_UNUSED and sub not in FP16_LACKING and sub != "enabled":
            raise ValueError(f"unknown fp16 key {sub!r} (misspelt?); DeepSpeed's are "
                             f"{sorted(['enabled', *FP16_FIELDS, *FP16_UNUSED, *FP16_LACKING])}")
    if not _enabled(value):
        ignored.append("fp16")
        return
    fields["compute_dtype"] = "fp16"
    for sub, advice in FP16_LACKING.items():
        if value.get(sub):
            raise ValueError(f"DeepSpeed key 'fp16.{sub}' = {value[sub]!r}: {advice}; remove it")
    for sub, field in FP16_FIELDS.items():
        if sub in value:
            v = value[sub]
            if field in ("initial_scale_power", "loss_scale_window", "hysteresis") and isinstance(v, float) \
                    and v.is_integer():
                v = int(v)
            fields[field] = v
    ignored.extend(f"fp16.{sub}" for sub in FP16_UNUSED if sub in value)


def _leaf_module(value: object) -> dict[str, tuple[str, ...]]:
    """zero_optimization.leaf_module -> the three leaf_module_* fields.

    A single string is a one-entry list and duplicates drop, as DeepSpeed's
    DeepSpeedZeroLeafModuleConfig validators do; an absent sub-key keeps its default.
    """
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"zero_optimization.leaf_module must be a dict with keys {sorted(LEAF_KEYS)}, "
                        f"got {value!r}")
    out: dict[str, tuple[str, ...]] = {}
    for sub, entries in value.items():
        if sub not in LEAF_KEYS:
            raise ValueError(f"unknown zero_optimization.leaf_module key {sub!r}; DeepSpeed's are "
                             f"{sorted(LEAF_KEYS)}")
        if isinstance(entries, str):
            entries = [entries]
        if not isinstance(entries, (list, tuple)) or not all(isinstance(e, str) for e in entries):
            raise TypeError(f"zero_optimization.leaf_module.{sub} must be a list of strings, "
                            f"got {entries!r}")
        out[LEAF_KEYS[sub]] = tuple(dict.fromkeys(entries))
    return out


def _data_types(section: object, compute_dtype: str) -> None:
    """data_types: grads accumulate in fp32 in fz3, params and buffers are cast to the compute
    dtype; any other request raises. DeepSpeed: engine.get_data_types, _mixed_precision_dtypes."""
    if section is None:
        return
    if not isinstance(section, Mapping):
        raise TypeError(f"data_types must be a dict, got {section!r}")
    allowed = {"grad_accum_dtype": "fp32", "param_dtype": compute_dtype, "buffer_dtype": compute_dtype}
    for key, value in section.items():
        if key not in allowed:
            raise ValueError(f"unknown data_types key {key!r}; DeepSpeed's are {sorted(allowed)}")
        want = allowed[key]
        if value is not None and value not in DTYPE_NAMES[want]:
            raise ValueError(f"DeepSpeed key 'data_types.{key}' = {value!r}: fz3 uses {want} here "
                             f"(compute dtype {compute_dtype}, fp32 grad accumulation); allowed: "
                             f"None or {DTYPE_NAMES[want]}")


def _batch_sizes(ds: Mapping[str, object]) -> None:
    """DeepSpeed derives gradient_accumulation_steps = train_batch_size / (micro batch x world
    size) when only the two batch sizes are given (DeepSpeedConfig._set_batch_related_parameters).
    fz3 reads the config before it knows the world size, so that case must say the steps."""
    if ("gradient_accumulation_steps" not in ds and "train_batch_size" in ds
            and "train_micro_batch_size_per_gpu" in ds):
        raise ValueError(f"train_batch_size = {ds['train_batch_size']!r} and "
                         f"train_micro_batch_size_per_gpu = {ds['train_micro_batch_size_per_gpu']!r} "
                         "without gradient_accumulation_steps: DeepSpeed derives the steps from the "
                         "world size, which fz3 does not know when it reads the config; add "
                         "gradient_accumulation_steps = train_batch_size / (micro batch x world size)")


def _as_int(key: str, value: object) -> int:
    """DeepSpeed JSON often writes sizes as floats (5e7); accept integral floats."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"DeepSpeed key {key!r} must be an integer, got {value!r}")
    return value


# [Note: "auto"] Hugging Face's DeepSpeed JSONs say "auto" where the Trainer fills in a value
# from TrainingArguments before DeepSpeed sees the dict. Given to DeepSpeed 0.19.8 itself
# (bench/deepspeed_records/deepspeed_facts.py, tests/data/deepspeed_facts_0.19.8.json), an "auto" inside a
# section DeepSpeed reads through pydantic (zero_optimization, bf16, fp16, ...) is dropped, so
# the field keeps its default (runtime/config_utils.py DeepSpeedConfigModel: `v != "auto"`):
# bf16.enabled "auto" is off, zero_optimization.stage "auto" is stage 0. A top-level key read
# by get_scalar_param keeps the string "auto", and DeepSpeed fails on it, at initialize or at
# the first step (AUTO_REFUSED: what it did), or treats it as true. fz3 keeps the defaults and
# refuses every top-level "auto" at once, naming the key; the JSON optimizer's and scheduler's
# params are the builders' (fz3/deepspeed/optimizers.py, schedulers.py).
AUTO_REFUSED: dict[str, str] = {
    "train_batch_size": "TypeError at initialize: '>' not supported between 'str' and 'int'",
    "train_micro_batch_size_per_gpu": "TypeError at initialize: '>' not supported between 'str' and 'int'",
    "gradient_accumulation_steps": "TypeError at initialize: '>' not supported between 'str' and 'int'",
    "gradient_clipping": "TypeError at the first step: '>' not supported between 'str' and 'float'",
    "steps_per_print": "TypeError at the first step: unsupported operand type(s) for %",
    "wall_clock_breakdown": "TypeError at initialize: unsupported operand type(s) for |",
}


def is_auto(value: object) -> bool:
    return isinstance(value, str) and value == "auto"


def auto_means_default(key: str, default: object) -> object:
    """What an "auto" at `key` means ([Note: "auto"]): `default`, DeepSpeed's, or an error."""
    if key in AUTO_REFUSED or "." not in key:
        did = AUTO_REFUSED.get(key, "it keeps the string 'auto' and fails on it or reads it as true")
        raise ValueError(f"DeepSpeed key {key!r} is \"auto\", which DeepSpeed 0.19.8 does not resolve "
                         f"(DeepSpeed: {did}): set a value (the Hugging Face Trainer fills \"auto\" from "
                         "TrainingArguments before DeepSpeed sees the config; fz3.hf.Trainer does too)")
    return default
