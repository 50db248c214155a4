"""What a DeepSpeed JSON says once the world size is known: the part `fz3.deepspeed` reads
itself (batch sizes, the JSON optimizer and scheduler, save_16bit_model's switch), and the
rest as fz3's Config.

    read_config(config)                       a dict, a JSON path, or base64 JSON -> dict
    read_settings(ds_dict, world_size=W)      -> Settings
    unresolved_autos(ds_dict)                 the "auto" values only Hugging Face's Trainer fills

    DeepSpeed JSON --read_settings--> Settings --+-- config: fz3.Config (Config.from_deepspeed)
                                                 +-- batch sizes, derived and checked
                                                 +-- optimizer / scheduler sections (or None)
                                                 +-- gather_16bit_weights_on_model_save

[Note: the keys fz3.deepspeed reads] Config.from_deepspeed keeps DeepSpeed's stage-3 knobs and
rejects what a bare `fz3.initialize` cannot honour: a JSON optimizer or scheduler, since it is
handed a built optimizer. `fz3.deepspeed.initialize` builds them, so it takes those sections
(and the batch sizes, dataloader_drop_last and stage3_gather_16bit_weights_on_model_save) out
before the rest goes to Config.from_deepspeed, which still names every other key it does not
implement. DeepSpeed: runtime/config.py DeepSpeedConfig.

[Note: one reader] `python -m fz3 plan --config` and `check --config` read the file through
read_config and read_settings too, so a JSON that fz3.deepspeed.initialize takes is taken there
with the same meaning: the JSON optimizer is built (the plan counts its state), the scheduler
checked. What a plan or a check has that initialize has not: its example inputs are the batch,
so a config without batch sizes is read (`batch_sizes_required=False`), and a check runs several
world sizes, so it keeps the given ones unchecked (`world_size=None`). A config whose "auto"
values only Hugging Face's Trainer fills (unresolved_autos) is first filled as fz3.hf.Trainer
fills it (fz3/hf/arguments.py), then read here.
"""
from __future__ import annotations

import base64
import binascii
import json
import os
import warnings
from dataclasses import dataclass
from typing import Mapping, Optional

from fz3.config.deepspeed_keys import auto_means_default, is_auto
from fz3.config.config import Config

# zero_optimization spellings of save_16bit_model's switch (DeepSpeedZeroConfig: field, alias,
# deprecated name)
GATHER_16BIT_KEYS = ("stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
                     "stage3_gather_fp16_weights_on_model_save")
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


class DeepSpeedConfigError(ValueError, AssertionError):
    """A DeepSpeed config DeepSpeed itself refuses, with DeepSpeed's message. DeepSpeed raises
    these as AssertionError; a ValueError here too, so the check survives `python -O` and
    `except ValueError` catches it."""


@dataclass(frozen=True)
class Settings:
    """A DeepSpeed JSON read for a world of `world_size` ranks."""

    config: Config
    train_batch_size: Optional[int]  # None only where not required and not given ([Note: one reader])
    train_micro_batch_size_per_gpu: Optional[int]
    gradient_accumulation_steps: int
    optimizer: Optional[Mapping[str, object]]  # the JSON "optimizer" section, or None
    scheduler: Optional[Mapping[str, object]]  # the JSON "scheduler" section, or None
    gather_16bit_weights_on_model_save: bool = False
    dataloader_drop_last: bool = False


def read_config(config: object) -> dict:
    """A DeepSpeed config as a dict: a dict itself, a path to a JSON file, or base64 of JSON
    (DeepSpeed accepts all three). A duplicate key is an error, as in DeepSpeed. DeepSpeed
    reads the file with hjson, which also takes comments; fz3 reads strict JSON.
    DeepSpeed: runtime/tensor_parallel/init_utils.py load_ds_config."""
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, os.PathLike):
        config = os.fspath(config)
    if not isinstance(config, str):
        raise TypeError(f"DeepSpeed config must be a dict, a path to a JSON file or base64 JSON, "
                        f"got {type(config).__name__}")
    if os.path.exists(config):
        try:
            with open(config) as f:
                return json.load(f, object_pairs_hook=_no_duplicates)
        except json.JSONDecodeError as e:
            raise ValueError(f"DeepSpeed config {config!r} is not valid JSON: {e}") from e
    try:
        decoded = base64.urlsafe_b64decode(config).decode("utf-8")
        out = json.loads(decoded, object_pairs_hook=_no_duplicates)
    except (binascii.Error, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"DeepSpeed config {config!r}: no such file (and not base64 JSON); expected a "
                         "path to an existing JSON file, a dict, or base64 JSON (DeepSpeed: a ValueError)") from e
    if not isinstance(out, dict):
        raise ValueError(f"DeepSpeed config {config!r} decodes to {type(out).__name__}, not a JSON object")
    return out


def _no_duplicates(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"DeepSpeed config: duplicate key {key!r}")
        out[key] = value
    return out


def read_settings(ds: Mapping[str, object], *, world_size: Optional[int],
                  batch_sizes_required: bool = True) -> Settings:
    """[Note: the keys fz3.deepspeed reads] Settings from a DeepSpeed dict for `world_size`
    ranks: the batch sizes as DeepSpeed derives and checks them, the optimizer and scheduler
    sections as given, the rest through Config.from_deepspeed. For a plan or a check
    ([Note: one reader]): `batch_sizes_required` False reads a config that gives neither
    train_batch_size nor train_micro_batch_size_per_gpu (they stay None); `world_size` None
    keeps the given ones as they are, unchecked."""
    if not isinstance(ds, Mapping):
        raise TypeError(f"DeepSpeed config must be a dict, got {type(ds).__name__}")
    rest = dict(ds)
    if world_size is not None and (batch_sizes_required or any(rest.get(k) is not None for k in BATCH_KEYS[:2])):
        train, micro, gas = batch_sizes(rest, world_size=world_size)
        for key in ("train_batch_size", "train_micro_batch_size_per_gpu"):
            rest.pop(key, None)
        rest["gradient_accumulation_steps"] = gas
    else:  # Config.from_deepspeed reads gradient_accumulation_steps
        train, micro = (_batch_value(rest, key) for key in BATCH_KEYS[:2])
    optimizer, scheduler = (_section(rest.pop(k, None), k) for k in ("optimizer", "scheduler"))
    drop_last = rest.pop("dataloader_drop_last", False)
    if is_auto(drop_last):
        auto_means_default("dataloader_drop_last", False)  # a top-level "auto": refused
    if not isinstance(drop_last, bool):
        raise TypeError(f"DeepSpeed key 'dataloader_drop_last' must be a bool, got {drop_last!r}")
    gather = False
    zero = rest.get("zero_optimization")
    if isinstance(zero, Mapping):
        zero = dict(zero)
        for key in GATHER_16BIT_KEYS:
            if key in zero:
                value = zero.pop(key)
                if is_auto(value):  # [Note: "auto"]: DeepSpeed's default
                    value = auto_means_default(f"zero_optimization.{key}", False)
                if not isinstance(value, bool):
                    raise TypeError(f"DeepSpeed key 'zero_optimization.{key}' must be a bool, got {value!r}")
                gather = value
        rest["zero_optimization"] = zero
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = Config.from_deepspeed(rest)
    for w in caught:  # re-raised here, so the warning points at the user's initialize call
        warnings.warn(w.message, w.category, stacklevel=4)
    return Settings(config=config, train_batch_size=train, train_micro_batch_size_per_gpu=micro,
                    gradient_accumulation_steps=config.gradient_accumulation_steps, optimizer=optimizer,
                    scheduler=scheduler, gather_16bit_weights_on_model_save=gather,
                    dataloader_drop_last=drop_last)


def unresolved_autos(ds: Mapping[str, object]) -> list[str]:
    """The keys of `ds` whose "auto" fz3.deepspeed does not resolve ([Note: "auto"] in
    fz3/config/deepspeed_keys.py): the top-level ones auto_means_default refuses, and any in the
    JSON optimizer's or scheduler's params (their builders refuse "auto": check_params in
    optimizers.py). Hugging Face's Trainer fills them from TrainingArguments, and so does
    fz3.hf.Trainer; python -m fz3 plan and check read such a config as fz3.hf.Trainer does
    ([Note: one reader])."""
    out = []
    for key, value in ds.items():
        if is_auto(value):
            try:
                auto_means_default(key, None)
            except ValueError:
                out.append(key)
    for key in ("optimizer", "scheduler"):
        params = ds.get(key, {}).get("params") if isinstance(ds.get(key), Mapping) else None
        if isinstance(params, Mapping):
            out.extend(f"{key}.params.{name}" for name, value in params.items() if is_auto(value))
    return out


def _section(value: object, key: str) -> Optional[Mapping[str, object]]:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise TypeError(f"DeepSpeed key {key!r} must be a dict with 'type' and 'params', got {value!r}")
    return value


def batch_sizes(ds: Mapping[str, object], *, world_size: int) -> tuple[int, int, int]:
    """(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps), the
    missing ones derived from the given ones and the world size, then checked, with DeepSpeed's
    messages. DeepSpeed: runtime/config.py _set_batch_related_parameters, _batch_assertion."""
    train, micro, gas = (_batch_value(ds, key) for key in BATCH_KEYS)
    if train is not None and micro is not None and gas is not None:
        pass
    elif train is not None and micro is not None:
        gas = train // micro // world_size
    elif train is not None and gas is not None:
        micro = train // world_size // gas
    elif micro is not None and gas is not None:
        train = micro * gas * world_size
    elif train is not None:
        gas, micro = 1, train // world_size
    elif micro is not None:
        train, gas = micro * world_size, 1
    else:
        raise DeepSpeedConfigError("Either train_batch_size or train_micro_batch_size_per_gpu needs to be "
                                   "provided (DeepSpeed's check; fz3 needs them for the dataloader, "
                                   "global_samples and train_batch_size())")
    if not train > 0:
        raise DeepSpeedConfigError(f"Train batch size: {train} has to be greater than 0")
    if not micro > 0:
        raise DeepSpeedConfigError(f"Micro batch size per gpu: {micro} has to be greater than 0")
    if not gas > 0:
        raise DeepSpeedConfigError(f"Gradient accumulation steps: {gas} has to be greater than 0")
    if train != micro * gas * world_size:
        raise DeepSpeedConfigError(
            "Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * "
            f"gradient_acc_step * world_size {train} != {micro} * {gas} * {world_size}")
    return train, micro, gas


def _batch_value(ds: Mapping[str, object], key: str) -> Optional[int]:
    value = ds.get(key)
    if is_auto(value):
        value = auto_means_default(key, None)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"DeepSpeed key {key!r} must be an integer, got {value!r}")
    return value
