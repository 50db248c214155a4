"""The engine methods that move a model's values in and out, as DeepSpeed's engine names them:

    engine.full_state_dict()                      consolidated fp32 params (fz3/io/consolidate.py)
    engine.full_optimizer_state_dict()            the unsharded optimizer's state_dict
                                                  (fz3/io/optimizer_state.py)
    engine.save_checkpoint(dir, tag, client_state)   sharded, atomic (fz3/io/checkpoint.py)
    engine.load_checkpoint(dir, tag, **options)      any saved world size (fz3/io/checkpoint_load.py)
    engine.save_16bit_model(dir, filename)         rank 0 writes the compute-dtype weights
    engine._zero3_consolidated_16bit_state_dict()  what Accelerate calls
    engine.full_params(bucket_bytes)               (name, whole param), a bucket at a time
                                                  (fz3/io/full_params.py)

They live here, with the features they call, so the shell's engine (fz3/shell/engine.py) never
imports a library feature; `fz3.initialize` returns an engine with them (fz3/api.py `Engine`).
"""
from __future__ import annotations

import os

import torch

from fz3.io.checkpoint import save_checkpoint
from fz3.io.checkpoint_load import load_checkpoint
from fz3.io.consolidate import compute_dtype_state_dict, full_state_dict
from fz3.io.full_params import full_params
from fz3.interpreters import agreement
from fz3.io.optimizer_state import full_optimizer_state_dict
from fz3.shell import log
from fz3.interpreters.agree import every_rank


class ValueMovers:
    """Mixed into the engine fz3.initialize returns (fz3/api.py), so `self` is that engine."""

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Consolidated fp32 params (and buffers), keys as the model's state_dict."""
        self._refuse_if_stopped()
        every_rank(self, agreement.FULL_STATE)
        with self.resident():
            return full_state_dict(self)

    def full_optimizer_state_dict(self) -> dict:
        """Every rank (it gathers): the optimizer's state_dict() as the same torch optimizer over the
        unsharded model returns it, every state tensor in its param's shape, on the CPU
        (fz3/io/optimizer_state.py). optimizer.load_state_dict takes it back on every rank.
        FSDP2: get_optimizer_state_dict(..., options=StateDictOptions(full_state_dict=True))."""
        self._refuse_if_stopped()
        with self.resident():
            return full_optimizer_state_dict(self)

    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None,
                        *, exclude_frozen_parameters: bool = False) -> bool:
        """Sharded, atomic checkpoint under save_dir/<tag> (fz3/io/checkpoint.py);
        `exclude_frozen_parameters`: without the params that do not require grad (a LoRA run's
        base: the adapters and their optimizer state only). DeepSpeed: save_checkpoint."""
        self._refuse_if_stopped()
        every_rank(self, agreement.SAVE)
        with self.resident():
            return save_checkpoint(self, save_dir, tag, client_state,
                                   exclude_frozen_parameters=exclude_frozen_parameters)

    def load_checkpoint(self, load_dir: str, tag: str | None = None, **options) -> tuple[str, dict]:
        """-> (path, client_state); any saved world size; DeepSpeed's load_optimizer_states,
        load_lr_scheduler_states, load_module_only (fz3/io/checkpoint_load.py).
        DeepSpeed: load_checkpoint."""
        self._refuse_if_stopped()
        every_rank(self, agreement.LOAD)
        with self.resident():
            return load_checkpoint(self, load_dir, tag, **options)

    def full_params(self, bucket_bytes: int = 2**28, merge_lora: bool = True):
        """Every rank (it gathers): (name, whole param) for every param in the model's order, in
        the compute dtype, a bucket of at most `bucket_bytes` gathered at a time; PEFT LoRA
        adapters merged into their weights, under the base model's names (fz3/io/full_params.py)."""
        self._refuse_if_stopped()
        every_rank(self, agreement.FULL_PARAMS)
        return full_params(self, bucket_bytes, merge_lora)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False):
        """Rank 0: the whole model's state dict in the compute dtype on the CPU (what
        save_16bit_model writes); other ranks: None. Every rank must call it. DeepSpeed's name,
        which Accelerate's get_state_dict calls: _zero3_consolidated_16bit_state_dict."""
        self._refuse_if_stopped()
        every_rank(self, agreement.SIXTEEN_BIT)
        return compute_dtype_state_dict(self, exclude_frozen_parameters=exclude_frozen_parameters)

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Rank 0 writes the whole model's weights in the compute dtype (torch.save of a state
        dict keyed as model.state_dict(), persistent buffers included, tied params one tensor)
        to save_dir/save_filename; -> True. Every rank must call it (it gathers). Without
        zero_optimization.stage3_gather_16bit_weights_on_model_save it writes nothing and
        returns False, as DeepSpeed (whose default that is). DeepSpeed: save_16bit_model,
        _zero3_consolidated_16bit_state_dict."""
        self._refuse_if_stopped()
        path = os.path.join(save_dir, save_filename)
        if not self.gather_16bit_weights_on_model_save:
            log.not_saved_16bit(self, path)
            return False
        state = self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)
        if self.rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            torch.save(state, path)
        self.transport.all_reduce(torch.zeros(1, device=self.device))  # written before any rank returns
        return True
