"""fz3.accelerate.Accelerator: Accelerate's Accelerator, training through fz3 (ZeRO-3), with one
import changed.

    from fz3.accelerate import Accelerator           # was: from accelerate import Accelerator
    accelerator = Accelerator(gradient_accumulation_steps=2, fz3_config="ds.json")
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)               # the engine's backward, and its step at the
            optimizer.step(); scheduler.step(); optimizer.zero_grad()   # boundary: these do nothing

The config: `fz3_config` (a fz3.Config, a DeepSpeed dict or a JSON path; "auto" values keep
DeepSpeed's defaults, an "auto" or absent gradient_accumulation_steps is the Accelerator's, and
a stated one that differs wins, with a WARNING, as Accelerate's DeepSpeed path rules:
accelerate/accelerator.py `_prepare_deepspeed`), or the DeepSpeed config of
Accelerate's own config file (`accelerate launch` with `deepspeed_config_file`, or a
DeepSpeedPlugin given as deepspeed_plugin=), which then goes to fz3, DeepSpeed never set up.
Without either: the plain Accelerator. What each call does, as Accelerate does under DeepSpeed
(accelerate/utils/deepspeed.py):

    prepare          each model with its optimizer (and scheduler) -> fz3.initialize; the engine is
                     returned as the model (call it as the model); a model without an optimizer
                     becomes an engine without one (frozen, forward-only: a reference model); the
                     dataloaders as the plain Accelerator prepares them
    backward(loss)   engine.backward, and engine.step() when the Accelerator syncs (the window's
                     last micro-batch under accumulate()): the engine clips, steps the optimizer
                     and the scheduler
    optimizer.step / zero_grad       nothing (the engine did them)
    scheduler.step   as the plain Accelerator steps it: at a boundary whose step was applied, once
                     per process unless split_batches (accelerate's AcceleratedScheduler; under
                     DeepSpeed, Accelerate lets the engine step it once a boundary instead, so a
                     schedule sized for plain Accelerate ends early there: [Note: the scheduler's
                     steps])
    accumulate       the micro-batches of a window run as they are (no_sync has nothing to turn off)
    clip_grad_norm_  the global grad norm of the last boundary (before clipping); the engine clips
                     at the config's gradient_clipping, which must be max_norm (else an error: the
                     step has already run)
    save_state / load_state   the engine's sharded checkpoint in the folder, beside Accelerate's
                     own (the scheduler, RNG states, dataloaders)
    unwrap_model     the model itself (fz3's hooks are on it)
    get_state_dict   the whole model's state dict in the compute dtype on rank 0 (every rank calls)

Importing this module imports accelerate; `import fz3` never does.
"""
from __future__ import annotations

import contextlib
import logging
import os

import accelerate
import torch
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from torch import nn

import fz3
from fz3.config.config import Config
from fz3.shell.optim import InferenceOnly


class EngineOptimizer(AcceleratedOptimizer):
    """The optimizer the script holds: the fz3-bound torch optimizer (its param groups and state
    are the fp32 master shards'), whose step() and zero_grad() do nothing, because engine.step()
    already stepped it at the boundary. `step_was_skipped`: the engine's skipped step (a
    non-finite global grad norm). accelerate: DeepSpeedOptimizerWrapper."""

    def __init__(self, optimizer: torch.optim.Optimizer, engine) -> None:
        super().__init__(optimizer, device_placement=False, scaler=None)
        self.engine = engine
        self._is_accelerate_prepared = True  # accelerator.prepare_optimizer registers it as it is

    def zero_grad(self, set_to_none=None) -> None:
        pass  # the engine starts each accumulation window itself

    def step(self, closure=None) -> None:
        pass  # engine.step() in the backward of the window's last micro-batch

    @property
    def step_was_skipped(self) -> bool:
        """The last boundary's step was skipped (a non-finite global grad norm)."""
        return not self.engine.was_step_applied()


# [Note: the scheduler's steps] Plain Accelerate steps a prepared scheduler num_processes times
# per optimizer step (AcceleratedScheduler: a schedule written for one process's dataloader
# length then ends when the data does), while under DeepSpeed the engine steps it once per
# boundary. An Accelerate script is written for the former, so fz3.accelerate keeps it: the
# scheduler stays Accelerate's, the engine is given none, and the losses equal plain Accelerate's
# step for step (tests/test_accelerate.py).


class Accelerator(accelerate.Accelerator):
    def __init__(self, *args, fz3_config=None, **kwargs) -> None:
        plugin = kwargs.get("deepspeed_plugin")
        if fz3_config is None and isinstance(plugin, dict):
            raise ValueError(f"fz3.accelerate: deepspeed_plugin is a dict of {len(plugin)} plugins "
                             f"({', '.join(map(repr, plugin))}); fz3 takes one config for every model an "
                             "Accelerator prepares: give one DeepSpeedPlugin, or fz3_config=")
        if fz3_config is None and plugin is not None:  # Accelerate's DeepSpeedPlugin: its config is fz3's
            fz3_config = plugin.deepspeed_config  # (its hf_ds_config's dict, or the one its fields make)
            kwargs["deepspeed_plugin"] = None
        if fz3_config is None and os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
            stage = int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3"))  # the config file's zero_stage
            fz3_config = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or {"zero_optimization": {"stage": stage}}
        env = {}  # fz3 takes DeepSpeed's place: Accelerate must not set DeepSpeed up from the environment
        if fz3_config is not None and "ACCELERATE_USE_DEEPSPEED" in os.environ:  # (a plugin given under
            env = {"ACCELERATE_USE_DEEPSPEED": os.environ.pop("ACCELERATE_USE_DEEPSPEED")}  # `accelerate launch` too)
        if fz3_config is not None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            import fz3.launch  # under torchrun on CPU, Accelerate leaves the group to the script: join it
            fz3.launch.init_from_env()  # (if Accelerate still sees one process, prepare refuses to go on)
        try:
            super().__init__(*args, **kwargs)
        finally:
            os.environ.update(env)
        self.fz3_config = None if fz3_config is None else _config(fz3_config, self.gradient_accumulation_steps)
        gas = None if self.fz3_config is None else self.fz3_config.gradient_accumulation_steps
        if gas is not None and gas != self.gradient_accumulation_steps:
            logging.getLogger("fz3").warning(
                "fz3.accelerate: gradient accumulation steps mismatch: the Accelerator has %d, the DeepSpeed config "
                "has %d. Using the DeepSpeed config's value (as Accelerate does under DeepSpeed)",
                self.gradient_accumulation_steps, gas)
            self.gradient_accumulation_steps = gas
        self.fz3_engines: list = []  # every engine prepare built, the trained one first
        asked = str(self.mixed_precision)
        if self.fz3_config is not None and asked in ("bf16", "fp16") and self.fz3_config.compute_dtype != asked \
                and self.is_main_process:  # fz3's compute dtype is its config's: no autocast around it
            logging.getLogger("fz3").warning(
                "fz3.accelerate: the Accelerator asks for mixed_precision=%r, but the fz3 config computes in %s "
                "(Accelerate's autocast is off under it, as under DeepSpeed); add \"%s\": {\"enabled\": true} to "
                "the config to train in %s", asked, self.fz3_config.compute_dtype, asked, asked)

    # ---- prepare ----------------------------------------------------------------------------------

    def prepare(self, *args, device_placement=None):
        if self.fz3_config is None:
            return super().prepare(*args, device_placement=device_placement)
        import torch.distributed as dist
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world != self.num_processes:  # each rank would take every batch: data parallel in name only
            raise RuntimeError(f"fz3.accelerate: the process group has {world} ranks, but Accelerate sees "
                               f"{self.num_processes} process(es), so it would not split the data between them; "
                               "launch the script so that Accelerate sets up the processes itself (accelerate "
                               "launch with a multi-process config, or fz3.launch.run)")
        optimizers = [a for a in args if isinstance(a, torch.optim.Optimizer)]
        schedulers = [a for a in args if hasattr(a, "step") and hasattr(a, "optimizer") and
                      not isinstance(a, torch.optim.Optimizer)]
        out: dict[int, object] = {}
        for model in (a for a in args if isinstance(a, nn.Module)):
            mine = {id(p) for p in model.parameters()}
            opt = next((o for o in optimizers if any(id(p) in mine for g in o.param_groups for p in g["params"])), None)
            sched = next((s for s in schedulers if opt is not None and s.optimizer is opt), None)
            engine = fz3.initialize(model, opt, self.fz3_config)
            self.fz3_engines.insert(0 if opt is not None else len(self.fz3_engines), engine)
            out[id(model)] = engine
            if opt is not None:
                out[id(opt)] = EngineOptimizer(opt, engine)
            if sched is not None:  # stepped as the plain Accelerator steps it ([Note: the scheduler's steps])
                out[id(sched)] = AcceleratedScheduler(sched, [out[id(opt)]],
                                                      step_with_optimizer=self.step_scheduler_with_optimizer,
                                                      split_batches=self.split_batches)
                self._schedulers.append(out[id(sched)])
        left = [a for a in args if id(a) not in out and not any(a is o for o in optimizers)]
        prepared = super().prepare(*left, device_placement=device_placement) if left else ()
        prepared = list(prepared) if len(left) > 1 else [prepared] if left else []
        for a in left:
            out[id(a)] = prepared.pop(0)
        result = tuple(out.get(id(a), a) for a in args)
        return result[0] if len(result) == 1 else result

    def _trained(self):
        trained = [e for e in self.fz3_engines if not isinstance(e.optimizer, InferenceOnly)]
        if len(trained) != 1:
            raise RuntimeError(f"fz3.accelerate: {len(trained)} models prepared with an optimizer; "
                               "accelerator.backward and the calls around it drive one (as Accelerate does under "
                               "DeepSpeed): call engine.backward(loss) and engine.step() on each of several")
        return trained[0]

    # ---- the step ---------------------------------------------------------------------------------

    def no_sync(self, model):
        """accumulate()'s micro-batches inside a window: nothing to turn off (fz3 reduces each
        backward's grads into its partitions and steps at the boundary backward() marks)."""
        if any(model is e or model is e.module for e in self.fz3_engines):
            return contextlib.nullcontext()
        return super().no_sync(model)

    def backward(self, loss, **kwargs) -> None:
        if self.fz3_config is None:
            return super().backward(loss, **kwargs)
        if kwargs:
            raise NotImplementedError(f"fz3.accelerate: backward options {sorted(kwargs)} are not supported")
        engine = self._trained()
        engine.set_gradient_accumulation_boundary(self.sync_gradients)
        engine.backward(loss)
        if self.sync_gradients:
            engine.step()

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        if self.fz3_config is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        clip = self.fz3_config.gradient_clipping
        if clip != max_norm or norm_type != 2:
            raise ValueError(f"fz3.accelerate: clip_grad_norm_(max_norm={max_norm}, norm_type={norm_type}), but the "
                             f"engine clips in accelerator.backward, at the config's gradient_clipping={clip} "
                             "(L2): put gradient_clipping in the fz3 config (the step has already run)")
        norm = self._trained().get_global_grad_norm()
        return None if norm is None else torch.tensor(norm)

    # ---- state ------------------------------------------------------------------------------------

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs):
        if self.fz3_config is None:
            return super().save_state(output_dir, safe_serialization, **kwargs)
        out = super().save_state(output_dir, safe_serialization, **kwargs)
        folder = output_dir or out
        for i, engine in enumerate(self.fz3_engines):
            if not isinstance(engine.optimizer, InferenceOnly):
                engine.save_checkpoint(folder, tag=f"fz3_engine_{i}")
        return out

    def load_state(self, input_dir: str | None = None, **kwargs):
        if self.fz3_config is None:
            return super().load_state(input_dir, **kwargs)
        for i, engine in enumerate(self.fz3_engines):
            if not isinstance(engine.optimizer, InferenceOnly):
                engine.load_checkpoint(input_dir, tag=f"fz3_engine_{i}")
        return super().load_state(input_dir, **kwargs)

    def unwrap_model(self, model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        engine = next((e for e in self.fz3_engines if model is e or model is e.module), None)
        if engine is not None:
            return engine.module
        return super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)

    def get_state_dict(self, model, unwrap=True):
        engine = next((e for e in self.fz3_engines if model is e or model is e.module), None)
        if engine is not None:
            return engine._zero3_consolidated_16bit_state_dict()
        return super().get_state_dict(model, unwrap)


AUTO_DROPPED = ("train_micro_batch_size_per_gpu", "train_batch_size", "gradient_clipping")


def _config(given, gas: int) -> Config:
    """A fz3.Config from a Config, a DeepSpeed dict or a JSON path. Its gradient_accumulation_steps:
    the Accelerator's `gas` where the config leaves it "auto" or absent (a Config: at its default,
    1), else the config's, which the Accelerator then takes (Accelerate's rule under DeepSpeed:
    the DeepSpeed config's value wins, with a warning)."""
    import json
    import warnings
    if isinstance(given, Config):
        config = given
    else:
        ds = json.load(open(given)) if isinstance(given, (str, os.PathLike)) else dict(given)
        # "auto" batch sizes are Accelerate's to fill from the dataloaders (fz3 needs none), and an
        # "auto" clipping keeps DeepSpeed's default ([Note: "auto"], fz3/config/deepspeed_keys.py)
        ds = {k: v for k, v in ds.items() if not (v == "auto" and k in AUTO_DROPPED)}
        if ds.get("gradient_accumulation_steps", "auto") in ("auto", None):
            ds["gradient_accumulation_steps"] = gas
        with warnings.catch_warnings():  # the batch sizes are the dataloader's business
            warnings.filterwarnings("ignore", "fz3 accepts but does not use")
            return Config.from_deepspeed(ds)
    if config.gradient_accumulation_steps == 1:
        config = config.replace(gradient_accumulation_steps=gas)
    return config
