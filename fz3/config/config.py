"""fz3's configuration: DeepSpeed's stage-3 knobs, with DeepSpeed's names and defaults (fz3's
own switches, the gloo carriers and the debug mode, are fz3.Options: fz3/config/options.py).

    Config(...)                        frozen; validated on construction
    Config.from_deepspeed(ds_dict)     a real DeepSpeed JSON dict -> Config

Every transition of the core takes the config as an explicit keyword argument, so it shows in
reprs and in Hypothesis failure output.

[Note: unknown keys] A DeepSpeed config that names a key fz3 does not know is almost always a
typo ("stage3_prefetch_bucket_sise") that DeepSpeed itself would silently drop. fz3 raises,
naming the key. Keys DeepSpeed knows but that change nothing in fz3 (steps_per_print, wandb,
...) are accepted and listed in one warning. A key that changes DeepSpeed's training and that
fz3 does not implement (offload, hpZ, a JSON optimizer, gradient_allreduce_op 'sum', ...)
raises, naming the key, its value and what to do instead: never a warning for a behaviour
change.

[Note: leaf modules by default] DeepSpeed 0.19 marks three Hugging Face MoE blocks as leaf
modules when the JSON says nothing (`DEFAULT_LEAF_MODULE_CLASSES`, deepspeed/runtime/zero/
leaf_module_config.py): their experts are picked by the data, so without the mark ranks would
fetch different modules. fz3 keeps that default, so the same model trains the same way; a
default class absent from the model is skipped, while any other entry that matches nothing is
an error (fz3/shell/tables.py).
"""
from __future__ import annotations

import dataclasses
import math
import sys
import warnings
from dataclasses import dataclass
from typing import Mapping, Optional

from fz3.config.offload import Aio, OffloadOptimizer, OffloadParam, section

COMPUTE_DTYPES = ("fp32", "bf16", "fp16")
# communication_data_type (DeepSpeed's names, runtime/config.py get_communication_data_type)
# -> the torch dtype name the core's effects carry
COMM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# DeepSpeed 0.19's zero_optimization.leaf_module.classes when the JSON gives none
DEFAULT_LEAF_MODULE_CLASSES = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)
LEAF_FIELDS = ("leaf_module_classes", "leaf_module_names", "leaf_module_name_suffixes")


@dataclass(frozen=True)
class Config:
    """DeepSpeed's ZeRO settings (`zero_optimization` names without the `stage3_` prefix), the
    stage among them (3 by default; fz3/core/stage.py), and the fp16 loss scale's.

    Sizes are in elements (numel), as in DeepSpeed.
    """

    # ZeRO stage (zero_optimization.stage): 3 partitions params, grads and optimizer state; 2
    # keeps params whole; 1 also grads (reduced at the boundary); 0 everything (data parallel).
    # Policies of the one lifecycle: fz3/core/stage.py
    stage: int = 3
    prefetch_bucket_size: int = 50_000_000  # numel of the plan prefetch reaches ahead (so the params
    # gathered ahead of need, give or take one param: [Note: prefetch bounds]); 0 turns prefetch off
    max_live_parameters: int = 1_000_000_000  # prefetch never lifts live full-param numel past this
    max_reuse_distance: int = 1_000_000_000  # keep a param if reused within this numel ahead
    param_persistence_threshold: int = 100_000  # params this small stay gathered all step
    reduce_bucket_size: int = 500_000_000  # IPG bucket capacity in grad elements
    contiguous_gradients: bool = True
    reduce_scatter: bool = True  # False, with contiguous_gradients: all-reduce + local slice
    overlap_comm: bool = True  # gathers and reduces on their own streams
    gradient_accumulation_steps: int = 1
    # False: every engine.step() closes the accumulation window, whatever the count of step()
    # calls before it (DeepSpeed's top-level key; [Note: the window closes at step()],
    # fz3/core/grad/epilogue.py)
    managed_gradient_accumulation: bool = True
    gradient_clipping: float = 0.0  # global grad-norm clip; 0 = off
    compute_dtype: str = "fp32"  # "fp32" | "bf16" | "fp16" (with loss scaling); master shards are always fp32
    # DeepSpeed's "fp16" section: the loss scale (fz3/core/grad/scaler.py). 0: dynamic, starting at
    # 2 ** initial_scale_power, halved after `hysteresis` overflows (not below min_loss_scale),
    # doubled after loss_scale_window steps without one; > 0: that scale, fixed. Read in fp16 only
    loss_scale: float = 0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False  # refill the hysteresis at every step without overflow
    min_loss_scale: float = 1
    # the dtype grads are reduced in: "fp32" | "bf16" | "fp16"; None = each grad's own dtype.
    # Partitions accumulate in fp32 whatever it is.
    communication_data_type: Optional[str] = None
    # divide each grad by the world size before the reduce (instead of after): the sum stays
    # in the range of a narrow comm dtype. The mean gradient is the same (fz3/core/grad/grads.py)
    prescale_gradients: bool = False
    # without prescale_gradients: divide each grad by this before the reduce, undone after
    gradient_predivide_factor: float = 1.0
    # persistent params (numel <= param_persistence_threshold) hold at most this many elements
    # in all, taken greedily in parameter order; DeepSpeed's default is sys.maxsize (no cap)
    model_persistence_threshold: int = sys.maxsize
    # leaf modules named by the config (see the module's [Note: leaf modules by default]):
    # class names, bare or module-qualified; module names as named_modules() gives them; name
    # suffixes. Tuples (lists are converted) so the Config stays hashable
    leaf_module_classes: tuple[str, ...] = DEFAULT_LEAF_MODULE_CLASSES
    leaf_module_names: tuple[str, ...] = ()
    leaf_module_name_suffixes: tuple[str, ...] = ()
    # DeepSpeed's offload sections (fz3/config/offload.py; each also as its JSON dict): "nvme" puts
    # the fp32 masters and the optimizer state of the offloaded sub-groups on disk, stepped one
    # sub-group at a time (fz3/core/offload.py); "cpu" on CPU ranks is where the data lives
    offload_optimizer: OffloadOptimizer = OffloadOptimizer()
    offload_param: OffloadParam = OffloadParam()
    aio: Aio = Aio()
    # numel of the optimizer's sub-groups: its unit of stepping, and of the disk's reads and
    # writes under offload (a sub-group closes once it reaches this size, as in DeepSpeed)
    sub_group_size: int = 1_000_000_000
    # gathers in flight at once: a further one first waits the oldest (DeepSpeed's hard-coded
    # __max_ongoing_fetch_events, 2; fz3/core/param/state.py `gather`). More overlaps more
    # gathers with compute and holds more gathered buffers
    max_ongoing_fetch_events: int = 2
    # hybrid sharding (FSDP2's HSDP): params, grads, fp32 masters and optimizer state are
    # sharded within each group of this many consecutive ranks and replicated across the
    # groups; grads are reduced within the group, then across the groups. 0: one group of the
    # whole world (flat ZeRO-3). It must divide the world size ([Note: hybrid sharding],
    # fz3/core/stage.py)
    shard_group_size: int = 0
    # ZeRO++'s hpZ (DeepSpeed's zero_hpz_partition_size): after the forward's gather, each
    # param keeps a secondary shard over groups of this many consecutive ranks, and the
    # backward gathers from those, within the group (a node). 1: off. Stage 3 only; it must
    # divide the shard group ([Note: hpZ], fz3/core/stage.py)
    zero_hpz_partition_size: int = 1
    # DeepSpeed's stage3_module_granularity_threshold: every module whose params per layer
    # (its subtree's params over its layers) are at most this is a leaf module, one fetch unit
    # with no hooks below it ([Note: leaf modules by granularity], fz3/core/granularity.py).
    # 0: off. Stage 3 only
    module_granularity_threshold: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stage, bool) or self.stage not in (0, 1, 2, 3):
            raise ValueError(f"Config.stage (zero_optimization.stage) must be 0, 1, 2 or 3, got {self.stage!r}: 0 data "
                             "parallel, 1 partitions the optimizer state, 2 also the grads, 3 also the params")
        for name in ("prefetch_bucket_size", "max_live_parameters", "max_reuse_distance",
                     "param_persistence_threshold", "model_persistence_threshold"):
            _check_int(name, getattr(self, name), low=0)
        _check_int("reduce_bucket_size", self.reduce_bucket_size, low=1)
        _check_int("max_ongoing_fetch_events", self.max_ongoing_fetch_events, low=1, what="gathers")
        _check_int("gradient_accumulation_steps", self.gradient_accumulation_steps, low=1)
        _check_int("shard_group_size", self.shard_group_size, low=0, what="ranks")
        if self.shard_group_size == 1:
            raise ValueError("Config.shard_group_size=1 splits no param: every rank would hold everything, which is "
                             "stage 0 (data parallel); use Config(stage=0), or a group of 2 or more ranks")
        if self.shard_group_size and self.stage == 0:
            raise ValueError(f"Config.shard_group_size={self.shard_group_size} shards within groups of ranks, but at "
                             "stage 0 nothing is sharded (every rank holds everything): use stage 1, 2 or 3, or "
                             "leave shard_group_size at 0")
        _check_int("zero_hpz_partition_size", self.zero_hpz_partition_size, low=1, what="ranks")
        if self.zero_hpz_partition_size > 1 and self.stage != 3:
            raise ValueError(f"Config.zero_hpz_partition_size={self.zero_hpz_partition_size} keeps a secondary "
                             f"shard of each gathered param, but at stage {self.stage} params stay whole on every "
                             "rank (nothing is gathered): use stage 3, or leave zero_hpz_partition_size at 1")
        _check_int("module_granularity_threshold", self.module_granularity_threshold, low=0)
        if self.module_granularity_threshold and self.stage != 3:
            raise ValueError(f"Config.module_granularity_threshold={self.module_granularity_threshold} makes small "
                             f"modules leaf modules (fetch units), but at stage {self.stage} params stay whole on "
                             "every rank (nothing is fetched): use stage 3, or leave module_granularity_threshold at 0")
        for name in ("contiguous_gradients", "reduce_scatter", "overlap_comm", "prescale_gradients",
                     "managed_gradient_accumulation", "consecutive_hysteresis"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Config.{name} must be a bool, got {getattr(self, name)!r}")
        clip = self.gradient_clipping
        if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip >= 0:
            raise ValueError(f"Config.gradient_clipping must be a number >= 0 (0 = off), got {clip!r}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"Config.compute_dtype must be one of {COMPUTE_DTYPES}, "
                             f"got {self.compute_dtype!r}")
        if self.communication_data_type is not None and self.communication_data_type not in COMM_DTYPES:
            raise ValueError(f"Config.communication_data_type must be None (each grad's own dtype) "
                             f"or one of {tuple(COMM_DTYPES)}, got {self.communication_data_type!r}")
        factor = self.gradient_predivide_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (
                math.isfinite(factor) and factor > 0):
            raise ValueError(f"Config.gradient_predivide_factor must be a finite number > 0 "
                             f"(1.0 = off), got {factor!r}")
        for name in LEAF_FIELDS:
            object.__setattr__(self, name, _str_tuple(name, getattr(self, name)))
        self._check_loss_scale()
        self._check_offload()

    def _check_offload(self) -> None:
        """The sections as values, and offload only where DeepSpeed 0.19.8 offloads: it ignores
        offload_param below stage 3 and offload_optimizer at stage 0, and keeps an "nvme" optimizer
        in host memory at stages 1 and 2, all silently (tests/data/deepspeed_offload_0.19.8.json);
        fz3 says so instead."""
        for name, cls in (("offload_optimizer", OffloadOptimizer), ("offload_param", OffloadParam), ("aio", Aio)):
            object.__setattr__(self, name, section(cls, f"Config.{name}", getattr(self, name)))
        if isinstance(self.sub_group_size, float) and self.sub_group_size.is_integer():
            object.__setattr__(self, "sub_group_size", int(self.sub_group_size))  # JSON's 1e9
        _check_int("sub_group_size", self.sub_group_size, low=1)
        opt, par = self.offload_optimizer, self.offload_param
        if par.on and self.stage != 3:
            raise ValueError(f"zero_optimization.offload_param.device = {par.device!r} at stage {self.stage}: DeepSpeed "
                             "offloads params at stage 3 only (DeepSpeed 0.19.8 ignores the key below it, silently); "
                             "use stage 3, or remove offload_param")
        if opt.on and self.stage == 0:
            raise ValueError(f"zero_optimization.offload_optimizer.device = {opt.device!r} at stage 0: DeepSpeed "
                             "offloads the optimizer at stages 1, 2 and 3 (DeepSpeed 0.19.8 ignores the key at stage "
                             "0, silently); use stage 1 or more, or remove offload_optimizer")
        if opt.device == "nvme" and self.stage in (1, 2):
            raise ValueError(f"zero_optimization.offload_optimizer.device = 'nvme' at stage {self.stage}: DeepSpeed "
                             "0.19.8 writes the optimizer to NVMe at stage 3 only (at stages 1 and 2 it keeps it in "
                             "host memory, as 'cpu'); use 'cpu', or stage 3")
        if opt.on and opt.ratio < 1 and self.stage != 3:
            raise ValueError(f"zero_optimization.offload_optimizer.ratio = {opt.ratio} at stage {self.stage}: DeepSpeed "
                             "offloads part of the optimizer at stage 3 only (DeepSpeed 0.19.8: 'Partial offloading "
                             "only supported for ZeRO Stage 3'); use stage 3, or ratio 1")

    def _check_loss_scale(self) -> None:
        """The fp16 section's values, as DeepSpeed 0.19.8 checks them (precision_config.py), and
        hysteresis 0, which DeepSpeed takes and then never halves the scale: after the first
        overflow every step would be skipped."""
        scale = self.loss_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (math.isfinite(scale) and scale >= 0):
            raise ValueError(f"Config.loss_scale (fp16.loss_scale) must be a finite number >= 0 (0: dynamic loss "
                             f"scaling), got {scale!r}")
        _check_int("initial_scale_power", self.initial_scale_power, low=0, what="the first scale is 2 ** it")
        _check_int("loss_scale_window", self.loss_scale_window, low=1, what="steps")
        _check_int("hysteresis", self.hysteresis, low=0, what="overflows")
        if self.hysteresis == 0:
            raise ValueError("Config.hysteresis (fp16.hysteresis) = 0: DeepSpeed 0.19.8 accepts it, but its count "
                             "then runs past 1 and the loss scale never halves, so after the first overflow every "
                             "step is skipped; use 1 (halve at every overflow) or more (DeepSpeed's default: 2)")
        low = self.min_loss_scale
        if isinstance(low, bool) or not isinstance(low, (int, float)) or not (math.isfinite(low) and low > 0):
            raise ValueError(f"Config.min_loss_scale (fp16.min_loss_scale) must be a finite number > 0, got {low!r}")

    @property
    def reduce_path(self) -> str:
        """'allreduce' (the contiguous bucket all-reduced, each rank keeps its slice) when
        contiguous_gradients and not reduce_scatter, else 'reduce_scatter'; without a
        contiguous bucket there is nothing to all-reduce, so reduce_scatter=False changes
        nothing there. DeepSpeed: stage3.py __reduce_and_partition_ipg_grads (contiguous and
        not reduce_scatter: __avg_scatter_contiguous_grads; else __avg_scatter_grads). Stage 0
        always all-reduces (fz3/core/stage.py)."""
        if self.stage == 0:  # every rank keeps the whole mean grad: DeepSpeed's allreduce_gradients
            return "allreduce"
        return "allreduce" if self.contiguous_gradients and not self.reduce_scatter else "reduce_scatter"

    def replace(self, **changes: object) -> "Config":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_deepspeed(cls, ds: Mapping[str, object]) -> "Config":
        """Build a Config from a DeepSpeed JSON config dict (see the module note)."""
        from fz3.config.deepspeed_keys import translate

        fields, ignored = translate(ds)
        if ignored:
            warnings.warn("fz3 accepts but does not use these DeepSpeed keys: " + ", ".join(ignored),
                          stacklevel=2)
        return cls(**fields)


def _str_tuple(name: str, value: object) -> tuple[str, ...]:
    """A list or tuple of strings, as a tuple (a frozen Config must hash)."""
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise TypeError(f"Config.{name} must be a tuple (or list) of non-empty strings, got {value!r}")
    return tuple(value)


def _check_int(name: str, value: object, *, low: int, what: str = "numel") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"Config.{name} must be an int ({what}), got {value!r}")
    if value < low:
        raise ValueError(f"Config.{name} must be >= {low}, got {value}")


def differences(config: Config) -> dict[str, object]:
    """The fields of `config` that differ from Config()'s (DeepSpeed's defaults), in field order:
    what the log and the plan print."""
    default = Config()
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
            if getattr(config, f.name) != getattr(default, f.name)}
