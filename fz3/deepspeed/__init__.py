"""DeepSpeed's own surface, so a DeepSpeed ZeRO-3 script runs with one import changed:

    import fz3.deepspeed as deepspeed              # was: import deepspeed
    parser = deepspeed.add_config_arguments(parser)          # --deepspeed, --deepspeed_config
    engine, optimizer, dataloader, lr_scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=dataset)
    with deepspeed.zero.Init(): model = build()
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0): ...
    deepspeed.utils.set_z3_leaf_modules(model, [MoEBlock])
    deepspeed.init_distributed()

`initialize` reads the config as DeepSpeed does (a dict, a JSON path, `args.deepspeed_config`),
builds the JSON "optimizer" on the model's params and the JSON "scheduler" on it
(fz3/deepspeed/optimizers.py, schedulers.py), derives and checks the batch sizes against the
world size (settings.py), and hands the rest to `fz3.initialize`: the engine is the same one,
with DeepSpeed's counters and methods (fz3/shell/surface.py). What each name copies from
DeepSpeed 0.19.8, and where it departs, is in docs/deepspeed_map.md.
"""
from __future__ import annotations

import argparse
import os
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from fz3.deepspeed import utils, zero
from fz3.deepspeed.settings import DeepSpeedConfigError, read_config, read_settings

__all__ = ["initialize", "init_distributed", "add_config_arguments", "zero", "utils", "DeepSpeedConfigError"]

TORCH_DISTRIBUTED_DEFAULT_PORT = 29500  # DeepSpeed's constants.py


def initialize(args=None, model: Optional[nn.Module] = None, optimizer=None, model_parameters=None,
               training_data=None, lr_scheduler=None, distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT,
               mpu=None, dist_init_required: Optional[bool] = None, collate_fn: Optional[Callable] = None,
               config=None, mesh_param=None, config_params=None):
    """-> (engine, optimizer, training_dataloader, lr_scheduler), as deepspeed.initialize.

    config: a dict, a JSON path or base64 JSON; or `args.deepspeed_config` (not both).
    optimizer: a torch optimizer, or a callable taking `model_parameters` and returning one; None
    builds the JSON "optimizer" on `model_parameters` (default model.parameters()).
    lr_scheduler: a scheduler, or a callable taking the optimizer; None builds the JSON
    "scheduler", if any. training_data: a Dataset, for a DataLoader of
    train_micro_batch_size_per_gpu samples with a DistributedSampler (else None).
    The engine steps the optimizer and the scheduler itself, at each accumulation boundary.
    DeepSpeed: deepspeed.initialize; mpu, mesh_param (model and sequence parallelism) are not
    fz3's and raise."""
    from fz3.deepspeed.build import build_engine
    if model is None:
        raise ValueError("deepspeed.initialize requires a model")
    for name, value in (("mpu", mpu), ("mesh_param", mesh_param)):
        if value is not None:
            raise ValueError(f"deepspeed.initialize({name}={value!r}): fz3 is data parallel only "
                             f"(ZeRO-3); {name} sets model or sequence parallel groups")
    init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    if config is None:
        config = config_params
    given = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if given is not None:
        if config is not None:
            raise ValueError("deepspeed.initialize: a config came both as args.deepspeed_config "
                             f"({given!r}) and as config=; pass one (DeepSpeed's 'Not sure how to proceed')")
        config = given
    if config is None:
        raise ValueError("deepspeed.initialize needs a config: config=dict or JSON path, or "
                         "--deepspeed_config (DeepSpeed requires --deepspeed_config to specify "
                         "configuration file)")
    return build_engine(model, read_config(config), optimizer=optimizer, model_parameters=model_parameters,
                        training_data=training_data, lr_scheduler=lr_scheduler, collate_fn=collate_fn)


def init_distributed(dist_backend: Optional[str] = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT, verbose: bool = True,
                     timeout=None, init_method: Optional[str] = None,
                     dist_init_required: Optional[bool] = None, config=None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Join the default process group if it is not up: the one torchrun (or fz3.launch)
    describes in RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, or, with none of those set, a
    world of one process on 127.0.0.1:`distributed_port`. The backend is the device's (gloo,
    nccl, hccl; fz3/shell/pick.py); an explicit `dist_backend` must fit it. Nothing inside a
    rank of fz3.launch.run_threads. DeepSpeed: deepspeed.comm.init_distributed (no MPI
    discovery: fz3 reads torchrun's variables)."""
    from fz3 import launch
    from fz3.interpreters import threads
    if threads.current() is not None or dist.is_initialized() or dist_init_required is False:
        return
    if rank >= 0 and world_size > 0:
        os.environ.setdefault("RANK", str(rank))
        os.environ.setdefault("WORLD_SIZE", str(world_size))
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
    seconds = 1800.0 if timeout is None else (timeout.total_seconds() if hasattr(timeout, "total_seconds")
                                              else float(timeout))
    if init_method is not None:
        raise ValueError(f"init_distributed(init_method={init_method!r}): fz3 joins the group through "
                         "torchrun's environment variables (env://); leave init_method None")
    launch.init_from_env(timeout_s=seconds, backend=dist_backend)


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """--deepspeed, --deepspeed_config FILE (and the deprecated --deepscale, --deepscale_config),
    as DeepSpeed adds them. DeepSpeed: deepspeed.add_config_arguments."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="Deprecated enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)")
    group.add_argument("--deepscale_config", default=None, type=str, help="Deprecated DeepSpeed json configuration file.")
    return parser
