"""Translate a DeepSpeed JSON config dict into fz3 Config fields.

Tables, not logic: which DeepSpeed keys map to which Config field, which are known but unused
(accepted and reported), and which name features fz3 lacks (error unless switched off).
Key names and defaults follow DeepSpeed 0.19 (`deepspeed/runtime/zero/config.py`).
"""
from __future__ import annotations

from typing import Mapping

# zero_optimization key -> Config field
ZERO_FIELDS = {
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_max_live_parameters": "max_live_parameters",
    "stage3_max_reuse_distance": "max_reuse_distance",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "reduce_bucket_size": "reduce_bucket_size",
    "contiguous_gradients": "contiguous_gradients",
    "reduce_scatter": "reduce_scatter",
    "overlap_comm": "overlap_comm",
}
# DeepSpeed's aliases (pydantic `alias=`) for the same fields
ZERO_ALIASES = {
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
}
DEEPSPEED_GRADIENT_CLIPPING = 1.0  # DeepSpeed 0.19's default when the key is absent
INT_FIELDS = {"prefetch_bucket_size", "max_live_parameters", "max_reuse_distance",
              "param_persistence_threshold", "reduce_bucket_size", "gradient_accumulation_steps"}

ZERO_UNUSED = {
    "stage3_model_persistence_threshold", "stage3_gather_16bit_weights_on_model_save",
    "gather_16bit_weights_on_model_save", "sub_group_size", "allgather_partitions",
    "allgather_bucket_size", "use_multi_rank_bucket_allreduce", "round_robin_gradients",
    "ignore_unused_parameters", "elastic_checkpoint", "memory_efficient_linear",
    "override_module_apply", "load_from_fp32_weights", "pipeline_loading_checkpoint",
    "log_trace_cache_warnings", "enable_sanity_checks", "leaf_module", "cpu_offload",
    "stage3_use_all_reduce_for_fetch_params", "stage3_allgather_sequential",
    "save_muon_momentum_buffer_in_memory", "legacy_stage1", "mics_hierarchical_params_gather",
}
# zero_optimization features fz3 lacks: key -> predicate "the feature is switched on"
ZERO_LACKING = {
    "offload_param": lambda v: _offload_on(v),
    "offload_optimizer": lambda v: _offload_on(v),
    "zero_hpz_partition_size": lambda v: v not in (None, 1),
    "zero_quantized_weights": bool,
    "zero_quantized_nontrainable_weights": bool,
    "zero_quantized_gradients": bool,
    "zeropp_loco_param": lambda v: v is not None,
    "mics_shard_size": lambda v: v not in (None, -1),
    "zenflow": lambda v: v is not None,
    "stage3_module_granularity_threshold": lambda v: bool(v),
}

TOP_UNUSED = {
    "train_batch_size", "train_micro_batch_size_per_gpu", "steps_per_print",
    "wall_clock_breakdown", "dump_state", "prescale_gradients", "gradient_predivide_factor",
    "sparse_gradients", "communication_data_type", "optimizer", "scheduler",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "activation_checkpointing",
    "flops_profiler", "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger",
    "checkpoint", "data_types", "memory_breakdown", "aio", "elasticity", "autotuning",
    "compression_training", "data_efficiency", "curriculum_learning", "pipeline",
    "seq_parallel_communication_data_type", "torch_autocast", "timers", "monitor_config",
    "disable_allgather", "sparse_attention", "eigenvalue", "progressive_layer_drop",
    "gradient_accumulation_dtype", "graph_harvesting", "use_data_before_expert_parallel_",
    "compile", "nebula", "weight_quantization", "hybrid_engine", "dataloader_drop_last",
}
TOP_LACKING = {
    "fp16": lambda v: _enabled(v),
    "amp": lambda v: _enabled(v),
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
        _no_auto(key, value)
        if key == "zero_optimization":
            _zero(value, fields, ignored)
        elif key in ("bf16", "bfloat16"):
            if _enabled(value):
                fields["compute_dtype"] = "bf16"
        elif key == "gradient_accumulation_steps":
            fields[key] = _as_int(key, value)
        elif key == "gradient_clipping":
            fields[key] = value
        elif key in TOP_LACKING:
            if TOP_LACKING[key](value):
                raise ValueError(f"DeepSpeed key {key!r} = {value!r}: fz3 has no {key} (loss "
                                 "scaling); use bf16 or fp32 compute")
            ignored.append(key)
        elif key in TOP_UNUSED:
            ignored.append(key)
        else:
            raise ValueError(f"unknown DeepSpeed config key {key!r} (misspelt?); fz3 knows "
                             f"zero_optimization, bf16, gradient_accumulation_steps, "
                             f"gradient_clipping and DeepSpeed's other top-level keys")
    if "zero_optimization" not in ds:
        raise ValueError("DeepSpeed config has no 'zero_optimization' section; fz3 is stage 3 "
                         "only: add {'zero_optimization': {'stage': 3}}")
    return fields, ignored


def _zero(zero: object, fields: dict[str, object], ignored: list[str]) -> None:
    if not isinstance(zero, Mapping):
        raise TypeError(f"zero_optimization must be a dict, got {zero!r}")
    stage = zero.get("stage", 0)
    if stage != 3:
        raise ValueError(f"zero_optimization.stage = {stage!r}: fz3 implements stage 3 only")
    for key, value in zero.items():
        _no_auto(f"zero_optimization.{key}", value)
        canonical = ZERO_ALIASES.get(key, key)
        if key == "stage":
            continue
        if canonical in ZERO_FIELDS:
            field = ZERO_FIELDS[canonical]
            if value is None and field == "overlap_comm":  # DeepSpeed: None means True at stage 3
                value = True
            fields[field] = _as_int(key, value) if field in INT_FIELDS else value
        elif key in ZERO_LACKING:
            if ZERO_LACKING[key](value):
                raise ValueError(f"zero_optimization.{key} = {value!r}: fz3 does not implement "
                                 "this feature; remove the key or switch it off")
            ignored.append(f"zero_optimization.{key}")
        elif key in ZERO_UNUSED:
            ignored.append(f"zero_optimization.{key}")
        else:
            raise ValueError(f"unknown zero_optimization key {key!r} (misspelt?); fz3 uses "
                             f"{sorted(ZERO_FIELDS)} and stage")


def _as_int(key: str, value: object) -> int:
    """DeepSpeed JSON often writes sizes as floats (5e7); accept integral floats."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"DeepSpeed key {key!r} must be an integer, got {value!r}")
    return value


def _no_auto(key: str, value: object) -> None:
    if value == "auto":
        raise ValueError(f"DeepSpeed key {key!r} is 'auto': resolve it to a number first "
                         "(HF Trainer does this when it builds the engine)")


def _enabled(section: object) -> bool:
    if isinstance(section, Mapping):
        return bool(section.get("enabled", False))
    return bool(section)


def _offload_on(section: object) -> bool:
    if section is None:
        return False
    if isinstance(section, Mapping):
        return section.get("device", "none") not in ("none", None)
    return True
