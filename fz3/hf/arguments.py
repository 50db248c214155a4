"""The DeepSpeed config as fz3.hf reads it: where it comes from, and how its "auto" values are
filled (by transformers' own code, as the Trainer fills them for DeepSpeed).

    args = fz3.hf.TrainingArguments(..., deepspeed="ds.json")   # or --deepspeed ds.json through
                                                                # HfArgumentParser: fz3's config
    Trainer(args=args, fz3_config=...)  --take_config-->  the one config, and a line to log
    AutoFill(ds).trainer_config_process(args) ... trainer_config_finalize(args, model, steps)
    fill_auto(ds, model=m, world_size=W, steps=K)              # python -m fz3 plan / check

    where the config comes from                    what happens
    -------------------------------------------   --------------------------------------------
    Trainer(fz3_config=X)                          X
    fz3.hf.TrainingArguments(deepspeed=X)          X, moved to args.fz3_config before
      (or fz3_config=X)                            transformers sees it: no DeepSpeed set up
    transformers.TrainingArguments(deepspeed=X)    X; what transformers set up for DeepSpeed
      (builds only where deepspeed is installed)   on args is turned off [Note: deepspeed=]
    two of these, different                        ValueError

[Note: deepspeed=] A script that kept `--deepspeed ds.json` and switched to fz3.hf.Trainer means
"train this config, with fz3". transformers.TrainingArguments(deepspeed=X) cannot mean it:
its __post_init__ builds an HfTrainerDeepSpeedConfig, which needs deepspeed installed (without
it, the arguments are not built at all), sets transformers' global "ZeRO-3 is on" flag
(is_deepspeed_zero3_enabled(): from_pretrained then builds the model under deepspeed.zero.Init)
and gives Accelerate a DeepSpeed plugin. fz3.hf.TrainingArguments is transformers' class with
the same fields and flags plus `fz3_config`, where `deepspeed` goes before transformers looks
at it, so none of that happens. Plain arguments built with deepspeed installed are still taken
(their DeepSpeed setup turned off), but a model that from_pretrained already partitioned under
zero.Init is refused: fz3 cannot train DeepSpeed's partitions.
transformers: training_args.py TrainingArguments.__post_init__ (its step 12, DeepSpeed),
integrations/deepspeed.py.
"""
from __future__ import annotations

import dataclasses
import functools
import types
from typing import Optional

import transformers
from accelerate.utils.deepspeed import HfDeepSpeedConfig
from transformers.integrations import deepspeed as hf_deepspeed
from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

from fz3.config.deepspeed_keys import is_auto
from fz3.deepspeed.settings import read_config

USE_INSTEAD = "fz3.hf.TrainingArguments (the same fields and flags; deepspeed= is fz3's config there)"


class AutoFill(HfDeepSpeedConfig):
    """A DeepSpeed dict (or JSON path) whose "auto" values are filled from TrainingArguments by
    transformers' own code: `trainer_config_process` (batch sizes, gradient_clipping, the JSON
    optimizer's and scheduler's params, bf16) and, once the model and the number of steps are
    known, `trainer_config_finalize` (hidden-size based bucket sizes, the scheduler's steps;
    mismatches between the dict and TrainingArguments raise there, listing every one).

    transformers' HfTrainerDeepSpeedConfig cannot be built without deepspeed installed (its
    __init__ checks deepspeed's version; its base class is accelerate's reader only when
    deepspeed imports), so this is accelerate's reader with transformers' methods borrowed, one
    by one. Nothing here sets transformers' global "DeepSpeed ZeRO-3 is on" flag, which would
    send from_pretrained through deepspeed.zero.Init.
    transformers: integrations/deepspeed.py HfTrainerDeepSpeedConfig."""

    def __init__(self, config_file_or_dict) -> None:
        super().__init__(read_config(config_file_or_dict))  # fz3.deepspeed's reader; a deep copy
        self._dtype = None
        self.mismatches: list[str] = []

    dtype = HfTrainerDeepSpeedConfig.dtype
    is_auto = HfTrainerDeepSpeedConfig.is_auto
    fill_match = HfTrainerDeepSpeedConfig.fill_match
    fill_only = HfTrainerDeepSpeedConfig.__dict__["fill_only"]  # a partialmethod of fill_match
    trainer_config_process = HfTrainerDeepSpeedConfig.trainer_config_process
    trainer_config_finalize = HfTrainerDeepSpeedConfig.trainer_config_finalize


@dataclasses.dataclass
class TrainingArguments(transformers.TrainingArguments):
    """transformers.TrainingArguments whose `deepspeed` is fz3's config ([Note: deepspeed=]):
    it moves to `fz3_config` before transformers' __post_init__ runs, so no DeepSpeed is set up
    (deepspeed need not be installed), and fz3.hf.Trainer trains it as if given as fz3_config=.
    HfArgumentParser(fz3.hf.TrainingArguments) takes --deepspeed ds.json (and --fz3_config)."""

    fz3_config: dict | str | None = dataclasses.field(default=None, metadata={
        "help": "A DeepSpeed JSON config (a path or a dict) that fz3.hf.Trainer trains with fz3; "
                "--deepspeed lands here too."})

    def __post_init__(self) -> None:
        self.fz3_from_deepspeed = self.deepspeed is not None
        if self.fz3_from_deepspeed:
            self.fz3_config = _one(self.deepspeed, "TrainingArguments(deepspeed", self.fz3_config,
                                   "TrainingArguments(fz3_config", who="fz3.hf.TrainingArguments")
            self.deepspeed = None
        super().__post_init__()


def take_config(fz3_config, args, model) -> tuple[object, Optional[str]]:
    """The one DeepSpeed config fz3.hf.Trainer trains with (the module's table), before
    transformers.Trainer.__init__ sees `args`: -> (the config or None, the line to log or None).
    Two sources that differ raise ValueError, and so does a `model` DeepSpeed's zero.Init
    partitioned; both before `args` is changed."""
    moved = getattr(args, "fz3_config", None)  # fz3.hf.TrainingArguments'
    given = getattr(args, "deepspeed", None)  # only plain transformers.TrainingArguments keep it
    from_deepspeed = given is not None or getattr(args, "fz3_from_deepspeed", False)
    config = _one(_one(given, "TrainingArguments(deepspeed", moved, "TrainingArguments(fz3_config"),
                  "TrainingArguments(deepspeed" if from_deepspeed else "TrainingArguments(fz3_config",
                  fz3_config, "fz3.hf.Trainer(fz3_config")
    if config is not None:
        _refuse_deepspeed_params(model)
    if given is not None:
        _turn_off_deepspeed(args)
        return config, (f"fz3.hf.Trainer: TrainingArguments(deepspeed={_shown(given)}) is trained by fz3 "
                        f"(ZeRO-3), as fz3_config= would be; what transformers set up for DeepSpeed on "
                        f"these arguments (from_pretrained's zero.Init flag, Accelerate's DeepSpeed plugin) "
                        f"is turned off, and no DeepSpeed engine is built. Use {USE_INSTEAD} so that "
                        f"DeepSpeed is never set up")
    if getattr(args, "fz3_from_deepspeed", False):
        return config, (f"fz3.hf.Trainer: TrainingArguments(deepspeed={_shown(moved)}) is trained by fz3 "
                        f"(ZeRO-3), as fz3_config= would be: DeepSpeed is not imported, and no "
                        f"deepspeed.zero.Init or DeepSpeed engine touches the model")
    return config, None


def _refuse_deepspeed_params(model) -> None:
    """A model whose params DeepSpeed's zero.Init partitioned (from_pretrained while
    transformers' ZeRO-3 flag was on: [Note: deepspeed=]) cannot be trained by fz3."""
    if model is not None and any(hasattr(p, "ds_id") for p in model.parameters()):
        raise ValueError(f"fz3.hf.Trainer: the model's params were partitioned by DeepSpeed's zero.Init "
                         f"(from_pretrained after transformers.TrainingArguments(deepspeed=...) turned "
                         f"it on); build the arguments with {USE_INSTEAD} before loading the model")


def fill_auto(ds, *, model, world_size: int, steps: int) -> tuple[dict, dict[str, object]]:
    """`ds` with its "auto" values filled as fz3.hf.Trainer fills them (AutoFill: transformers'
    trainer_config_process, then trainer_config_finalize for `model` and `steps` optimizer
    steps) from TrainingArguments' defaults on `world_size` ranks, where `ds` itself gives no
    value: a run's TrainingArguments agree with every value the config gives (transformers
    refuses them otherwise), so those are kept, and the micro batch and accumulation steps it
    gives are the arguments' too (train_batch_size is derived from them). For python -m fz3
    plan / check, which have no TrainingArguments; none is built (that sets up Accelerate's
    process state). -> (the filled dict, {dotted key: the value filled in})."""
    fill = _PlanFill(ds)
    args = _default_arguments(world_size, fill.config)
    fill.trainer_config_process(args)
    fill.trainer_config_finalize(args, model, steps)
    return fill.config, _filled(read_config(ds), fill.config)


class _PlanFill(AutoFill):
    def fill_match(self, ds_key_long, hf_val, hf_key=None, must_match=True) -> None:
        """Fill an "auto"; a value the config gives is the run's (fill_auto), never a mismatch."""
        super().fill_match(ds_key_long, hf_val, hf_key, must_match=False)


def _default_arguments(world_size: int, ds: dict) -> types.SimpleNamespace:
    """What trainer_config_process and _finalize read of TrainingArguments: its field defaults,
    `world_size`, get_warmup_steps, and the micro batch and accumulation steps `ds` gives."""
    values = {f.name: f.default for f in dataclasses.fields(transformers.TrainingArguments)
              if f.default is not dataclasses.MISSING}
    for key, field in (("train_micro_batch_size_per_gpu", "per_device_train_batch_size"),
                       ("gradient_accumulation_steps", "gradient_accumulation_steps")):
        if isinstance(ds.get(key), int) and not isinstance(ds.get(key), bool):
            values[field] = ds[key]
    args = types.SimpleNamespace(**values, world_size=world_size)
    args.get_warmup_steps = functools.partial(transformers.TrainingArguments.get_warmup_steps, args)
    return args


def _filled(before: dict, after: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in before.items():
        if is_auto(value) and not is_auto(after.get(key)):
            out[prefix + key] = after.get(key)
        elif isinstance(value, dict) and isinstance(after.get(key), dict):
            out.update(_filled(value, after[key], f"{prefix}{key}."))
    return out


def _one(a, a_call: str, b, b_call: str, *, who: str = "fz3.hf.Trainer"):
    """a or b: a config given twice must be the same one (a path and the dict it holds are).
    `a_call`, `b_call`: where each came from, up to the "=" (the message closes the call)."""
    if a is not None and b is not None and read_config(a) != read_config(b):
        raise ValueError(f"{who}: a DeepSpeed config came twice, as {a_call}={_shown(a)}) and as "
                         f"{b_call}={_shown(b)}), and they differ: pass one (fz3 trains one config)")
    return a if a is not None else b


def _shown(config) -> str:
    return repr(config) if not isinstance(config, dict) else f"<a dict: {', '.join(map(str, config))}>"


def _turn_off_deepspeed(args) -> None:
    """Undo what transformers.TrainingArguments.__post_init__ set up for DeepSpeed on `args`:
    transformers' global weakref to its HfTrainerDeepSpeedConfig (is_deepspeed_zero3_enabled())
    and Accelerate's DeepSpeed plugin, before transformers.Trainer.__init__ reads them."""
    ours = getattr(args, "hf_deepspeed_config", None)
    ref = hf_deepspeed._hf_deepspeed_config_weak_ref
    if ours is not None and ref is not None and ref() is ours:
        hf_deepspeed.unset_hf_deepspeed_config()
    args.deepspeed, args.deepspeed_plugin, args.hf_deepspeed_config = None, None, None
