"""fz3.hf.Trainer: a transformers.Trainer that trains through fz3 (ZeRO-3), wired in where
transformers wires DeepSpeed.

    trainer = fz3.hf.Trainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                             fz3_config=ds_dict_or_json_path)   # "auto" values welcome
    trainer.train()                       # or train(resume_from_checkpoint=".../checkpoint-N")
    trainer.save_model(out_dir)           # every rank calls it; from_pretrained(out_dir) loads it

Run it on N ranks as any Trainer script (torchrun, or fz3.launch.run); without fz3_config it is
the plain transformers.Trainer. A script that kept `--deepspeed ds.json` builds its arguments as
fz3.hf.TrainingArguments and trains that config through fz3, DeepSpeed never set up
(fz3/hf/arguments.py, [Note: deepspeed=]). The Trainer's own loop (transformers 5.24 `_run_epoch`) runs
unchanged; what it calls is answered as Accelerate answers it under DeepSpeed:

    Trainer call site                   plain Trainer            fz3.hf.Trainer (HF + DeepSpeed)
    ----------------------------------  -----------------------  --------------------------------------
    __init__                            -                        "auto" filled from TrainingArguments
    _prepare_for_training               accelerator.prepare      "auto" finalized; optimizer/scheduler as
                                        (DDP)                    deepspeed_init; fz3.deepspeed.initialize;
                                                                 the fz3 checkpoint loaded on resume
    training_step: accelerator.backward loss.backward()          engine.backward(loss * gas); engine.step()
                                                                 (steps at the boundary only) [Note: backward]
    _clip_grad_norm / _get_grad_norm    clip_grad_norm_          engine.get_global_grad_norm() (the engine
                                                                 clipped at gradient_clipping)
    optimizer.step() / zero_grad()      step / zero              nothing (the engine stepped)
    lr_scheduler.step()                 step                     the Trainer's: step unless the engine
                                                                 skipped the step; the engine's: nothing
    save_model                          save_pretrained          rank 0 saves the gathered weights (compute
                                                                 dtype, as DeepSpeed's 16-bit state dict)
    _save_optimizer_and_scheduler       optimizer.pt             engine.save_checkpoint(dir, "global_stepN")
    (checkpoint-N; trainer_state.json,  + scheduler.pt           + scheduler.pt for the Trainer's scheduler
     rng_state_R.pth: the Trainer's)
    _load_from_checkpoint               weights into the model   nothing (loaded with the engine)
    _load_optimizer_and_scheduler       optimizer.pt             scheduler.pt for the Trainer's scheduler
    _load_best_model                    weights                  engine.load_checkpoint(best)

transformers: trainer.py (the `is_deepspeed_enabled` branches), integrations/deepspeed.py;
accelerate: utils/deepspeed.py (DeepSpeedEngineWrapper, DeepSpeedOptimizerWrapper).
"""
from __future__ import annotations

import copy
import glob
import logging
import os

import torch
import transformers
from transformers.trainer_pt_utils import remove_dummy_checkpoint
from transformers.trainer_utils import has_length
from transformers.utils import SAFE_WEIGHTS_NAME, WEIGHTS_NAME

from fz3.accelerate import EngineOptimizer  # accelerate: DeepSpeedOptimizerWrapper
from fz3.hf.arguments import AutoFill, take_config

LOG = logging.getLogger("fz3")
SCHEDULER_NAME = "scheduler.pt"  # transformers.trainer's name for the Trainer's scheduler state


class EngineScheduler:
    """What the Trainer holds as `lr_scheduler` when the engine was given the scheduler (a JSON
    "scheduler", or the Trainer's own on a JSON optimizer, as transformers hands it to
    DeepSpeed): the engine steps it at each applied boundary, so the Trainer's step() does
    nothing; the rest is the scheduler's. accelerate: DeepSpeedSchedulerWrapper."""

    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler

    def step(self, *args, **kwargs) -> None:
        pass  # engine.step() stepped it

    def __getattr__(self, name: str):  # get_last_lr, state_dict, optimizer, ...
        return getattr(self.scheduler, name)


class Fz3TrainerMixin:
    """Put first among the bases of any transformers.Trainer subclass (TRL's SFTTrainer,
    DPOTrainer, ...): it trains through fz3 when given `fz3_config` (a DeepSpeed dict or JSON
    path, "auto" values filled from `args` as transformers fills them for DeepSpeed), or
    TrainingArguments(deepspeed=...) (fz3/hf/arguments.py: taken as fz3_config, said once in
    the "fz3" log). Without either: the plain trainer. Each override answers one call site of
    transformers.Trainer (the table above) and defers to the next class otherwise, so the
    subclass's own steps (TRL's losses, its collators) run unchanged.

        class FzSFTTrainer(fz3.hf.Fz3TrainerMixin, trl.SFTTrainer): pass
        FzSFTTrainer(model=model, args=SFTConfig(...), train_dataset=ds, fz3_config=ds_json)
    """

    def __init__(self, *args, fz3_config=None, **kwargs) -> None:
        fz3_config, said = take_config(fz3_config, kwargs.get("args", args[1] if len(args) > 1 else None),
                                       kwargs.get("model", args[0] if args else None))
        super().__init__(*args, **kwargs)
        self.engine = None
        self.fz3_config = None if fz3_config is None else AutoFill(fz3_config)
        if self.fz3_config is None:
            return
        if said and self.is_world_process_zero():
            LOG.warning(said)
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError("fz3.hf.Trainer: fz3_config= trains through fz3; TrainingArguments also asks "
                             f"for {'DeepSpeed' if self.is_deepspeed_enabled else 'FSDP'}: drop one")
        self.fz3_config.trainer_config_process(self.args)  # as TrainingArguments does for DeepSpeed
        asked = [k for k in ("bf16", "fp16") if getattr(self.args, k, False)]
        if asked and not (self.fz3_config.is_true("bf16.enabled") or self.fz3_config.is_true("fp16.enabled")) \
                and self.is_world_process_zero():  # TRL's configs turn bf16 on by default
            LOG.warning("%s: TrainingArguments asks for %s, but the fz3 config has no %s section, so fz3 trains "
                        "in fp32 (as DeepSpeed would: the Trainer's autocast is off under it); add "
                        '"%s": {"enabled": "auto"} to train in %s, or set %s=False to say fp32',
                        type(self).__name__, asked[0], asked[0], asked[0], asked[0], asked[0])

    # ---- building the engine ------------------------------------------------------------------

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        """The DeepSpeed branch of Trainer._prepare_for_training: finalize the config, build the
        optimizer and scheduler as deepspeed_init does, the engine, and load the fz3 checkpoint
        when resuming. The model is not wrapped: fz3's hooks are on it, so `model` in the loop
        is the Trainer's own. -> (model, train_dataloader)."""
        if self.fz3_config is None:
            return super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        if self.engine is not None:
            raise RuntimeError("fz3.hf.Trainer.train() runs once per Trainer: its model is sharded by the "
                               "engine the first call built. Build a new model and Trainer, and pass "
                               "resume_from_checkpoint= to go on from a checkpoint")
        if self._created_lr_scheduler:
            self.lr_scheduler, self._created_lr_scheduler = None, False
        _check_windows(train_dataloader, max_steps, self.args.gradient_accumulation_steps)
        self.fz3_config.trainer_config_finalize(self.args, self.model, max_steps)
        self.engine, self.optimizer, self.lr_scheduler = self._initialize(max_steps)
        self._shard_frozen_models()
        if self.args.torch_compile:  # as Accelerate's prepare compiles a DeepSpeed engine
            mode = self.args.torch_compile_mode
            self.engine.compile(backend=self.args.torch_compile_backend or "inductor",
                                compile_kwargs={"mode": mode} if mode else None)
        self.model_wrapped = self.model
        if resume_from_checkpoint is not None:
            self._load_engine(resume_from_checkpoint)
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return self.model, train_dataloader

    def _shard_frozen_models(self) -> None:
        """The frozen models a subclass holds beside the trained one (TRL's `ref_model`, a
        reward or value model given as a module) are sharded too, as engines without an
        optimizer under the same config (fz3.initialize(model, None, config): forwards only), so
        no rank keeps them whole; TRL calls them as modules, and fz3's hooks are on the modules.
        Accelerate under DeepSpeed does the same with prepare_deepspeed (an inference engine)."""
        import fz3
        from fz3.shell import registry
        self.frozen_engines = {}
        for name in ("ref_model", "reward_model"):
            m = getattr(self, name, None)
            if isinstance(m, torch.nn.Module) and m is not self.model and registry.managed(m.parameters()) is None \
                    and any(True for _ in m.parameters()):
                self.frozen_engines[name] = fz3.initialize(m, None, self.engine.config)
                m.eval()

    def _initialize(self, max_steps: int):
        """-> (engine, EngineOptimizer, the Trainer's scheduler or an EngineScheduler).

        A JSON "optimizer" / "scheduler" is built by fz3.deepspeed as DeepSpeed builds it;
        otherwise the Trainer builds its own (create_optimizer, create_scheduler; `optimizers=`
        given to the Trainer are used). The Trainer's scheduler goes to the engine only on a JSON
        optimizer, as transformers hands it to DeepSpeed (DummyScheduler's
        lr_scheduler_callable); else the Trainer steps it. transformers: deepspeed_init,
        deepspeed_optim_sched (which also sets zero_allow_untested_optimizer, a key fz3 would
        only warn about: it takes any torch optimizer)."""
        import fz3.deepspeed
        ds = self.fz3_config.config
        optimizer = None if "optimizer" in ds else self.create_optimizer()
        scheduler = None
        if optimizer is None and "scheduler" not in ds:
            scheduler = lambda opt: self._trainer_scheduler(max_steps, opt)  # noqa: E731
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        engine, optimizer, _, engine_scheduler = fz3.deepspeed.initialize(
            model=self.model, optimizer=optimizer, model_parameters=trainable, lr_scheduler=scheduler,
            config=ds)
        if engine.gradient_accumulation_steps() != self.args.gradient_accumulation_steps:
            raise ValueError(  # fz3's windows are the Trainer's only if the counts agree
                f"fz3.hf.Trainer: the DeepSpeed config gives gradient_accumulation_steps="
                f"{engine.gradient_accumulation_steps()} (from its batch sizes), TrainingArguments "
                f"{self.args.gradient_accumulation_steps}; set it to \"auto\" or to the same value")
        wrapped = self.accelerator.prepare_optimizer(EngineOptimizer(optimizer, engine))
        if engine_scheduler is None:  # neither JSON: the Trainer's own, which the Trainer steps
            own = self.create_scheduler(num_training_steps=max_steps, optimizer=optimizer)
            return engine, wrapped, own
        return engine, wrapped, EngineScheduler(engine_scheduler)

    def _trainer_scheduler(self, max_steps: int, optimizer: torch.optim.Optimizer):
        """The Trainer's scheduler (args.lr_scheduler_type, warmup) on the engine's optimizer,
        built by a shallow copy of the Trainer, as deepspeed_optim_sched's callable does."""
        trainer = copy.copy(self)
        trainer.lr_scheduler = None
        return trainer.create_scheduler(num_training_steps=max_steps, optimizer=optimizer)

    # ---- the step --------------------------------------------------------------------------------

    def training_step(self, model, inputs, num_items_in_batch=None):
        """The Trainer's training_step, its `accelerator.backward(loss)` the engine's
        ([Note: backward])."""
        if self.engine is None:
            return super().training_step(model, inputs, num_items_in_batch)
        self.accelerator.backward = self._backward  # this call's only, on this Trainer's accelerator
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        finally:
            del self.accelerator.backward

    def _backward(self, loss: torch.Tensor, **kwargs) -> None:
        """[Note: backward] The Trainer has scaled the loss for the accumulation window (by 1/gas,
        or by the window's token count) and expects the reduce to average over ranks only: under
        DeepSpeed it turns off DeepSpeed's own 1/gas (scale_wrt_gas=False). fz3 divides the
        summed grads by world_size * gas at the boundary, so the loss goes in times gas. Then
        engine.step() after every backward, as DeepSpeed's loop (its counters count step()
        calls); fz3 steps only at the boundary, which must be where the Trainer syncs.
        accelerate: DeepSpeedEngineWrapper.backward."""
        if kwargs:
            raise NotImplementedError(f"fz3.hf.Trainer: backward options {sorted(kwargs)} (LOMO optimizers) "
                                      "are not supported")
        engine, sync = self.engine, self.accelerator.sync_gradients
        engine.backward(loss * self.args.gradient_accumulation_steps)
        windows = engine.optimizer_steps
        engine.step()
        if (engine.optimizer_steps != windows) != sync:
            raise RuntimeError(f"fz3.hf.Trainer: the Trainer {'closes' if sync else 'does not close'} an "
                               f"accumulation window at this micro-batch and fz3 "
                               f"{'does not' if sync else 'does'} (it closes one every "
                               f"{self.args.gradient_accumulation_steps} step() calls)")

    def _clip_grad_norm(self, model):
        """The engine clipped at its gradient_clipping; the Trainer logs the norm before it.
        accelerate: Accelerator.clip_grad_norm_ under DeepSpeed."""
        if self.engine is None:
            return super()._clip_grad_norm(model)
        return self.engine.get_global_grad_norm()

    def _get_grad_norm(self, model, grad_norm=None):
        if self.engine is None:
            return super()._get_grad_norm(model, grad_norm)
        return self.engine.get_global_grad_norm()

    # ---- saving ------------------------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Every rank calls it (the weights are gathered); rank 0 writes them with save_pretrained,
        in the compute dtype (fp32, or bf16 in a bf16 run), as transformers saves DeepSpeed
        ZeRO-3's 16-bit state dict. In the Trainer's checkpoint-N folders the weights are written
        only with zero_optimization.stage3_gather_16bit_weights_on_model_save, as under
        DeepSpeed (resuming reads the fz3 checkpoint; `python -m fz3.consolidate` gets the
        weights out of it); save_model called by the user always writes them.
        transformers: Trainer.save_model's DeepSpeed branch."""
        if self.engine is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = self.args.output_dir if output_dir is None else output_dir
        if _internal_call and not self.engine.gather_16bit_weights_on_model_save:
            self._save(output_dir, state_dict={})  # config, training args, tokenizer
            remove_dummy_checkpoint(self.args.should_save, output_dir, [WEIGHTS_NAME, SAFE_WEIGHTS_NAME])
            return None
        self._save(output_dir, state_dict=self._gathered_state_dict())
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
        return None

    def _gathered_state_dict(self) -> dict | None:
        """Rank 0: the whole weights in the compute dtype, keys as model.state_dict(), one param
        whole at a time; other ranks None. Every rank gathers.
        DeepSpeed: _zero3_consolidated_16bit_state_dict (rank 0's, as here)."""
        return self.engine._zero3_consolidated_16bit_state_dict()

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """fz3's sharded checkpoint (weights, optimizer, the engine's scheduler, counters) under
        output_dir/global_step{N}, DeepSpeed's tag; the Trainer's own scheduler beside it, as
        scheduler.pt (rank 0). transformers: Trainer._save_optimizer_and_scheduler."""
        if self.engine is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        # a PEFT model's frozen base is left out, as transformers asks DeepSpeed to
        # (exclude_frozen_parameters=is_peft_model(model)): the adapters and their optimizer state
        peft = type(self.model).__module__.startswith("peft.")
        self.engine.save_checkpoint(output_dir, tag=f"global_step{self.state.global_step}",
                                    exclude_frozen_parameters=peft)
        if self.args.should_save and not isinstance(self.lr_scheduler, EngineScheduler):
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
        return None

    # ---- loading ------------------------------------------------------------------------------------

    def _load_engine(self, checkpoint: str) -> None:
        """engine.load_checkpoint(checkpoint): its `latest` tag. transformers:
        deepspeed_load_checkpoint (which also refuses a folder without global_step*)."""
        if not glob.glob(os.path.join(checkpoint, "global_step*")):
            raise ValueError(f"Can't find a valid checkpoint at {checkpoint} (fz3.hf.Trainer looks for "
                             "an fz3 checkpoint in its global_step* folder)")
        self.engine.load_checkpoint(checkpoint)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None) -> None:
        """Nothing before the engine exists: _prepare_for_training loads the fz3 checkpoint."""
        if self.fz3_config is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        return None

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        """The optimizer came with the fz3 checkpoint; the Trainer's own scheduler from
        scheduler.pt. transformers: the DeepSpeed branch of _load_optimizer_and_scheduler."""
        if self.engine is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None and not isinstance(self.lr_scheduler, EngineScheduler):
            self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME),
                                                         weights_only=True))
        return None

    def _load_best_model(self) -> None:
        if self.engine is None:
            return super()._load_best_model()
        self._load_engine(self.state.best_model_checkpoint)
        return None



class Trainer(Fz3TrainerMixin, transformers.Trainer):
    """transformers.Trainer training through fz3: Fz3TrainerMixin's overrides on the plain Trainer."""

def _check_windows(dataloader, max_steps: int, gas: int) -> None:
    """The Trainer closes an epoch's last accumulation window early when the epoch's batches are
    not a multiple of gas; fz3 closes one every gas step() calls (its divisor is world_size * gas),
    so such a window is refused before training rather than after the epoch."""
    if not has_length(dataloader):
        return
    n = len(dataloader)
    if n % gas and max_steps > n // gas:
        raise ValueError(f"fz3.hf.Trainer: an epoch has {n} batches per rank, not a multiple of "
                         f"gradient_accumulation_steps={gas}, and training reaches the epoch's end "
                         f"(max_steps={max_steps}): its last window would have {n % gas} micro-batches, "
                         "fz3's always has gradient_accumulation_steps. Make the batches per epoch a "
                         "multiple of it (dataset size, dataloader_drop_last), or stop before the end")
