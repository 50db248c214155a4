"""deepspeed.initialize's work once the config is a dict: the optimizer, the scheduler, the
engine, the dataloader, in DeepSpeed's order.

    client optimizer? --yes--> it (a callable: called on model_parameters)
          | no
    JSON "optimizer"? --yes--> built on model_parameters (optimizers.py)
          | no
    error: ZeRO-3 trains with an optimizer
    client lr_scheduler? --yes--> it (a callable: called on the optimizer)
          | no
    JSON "scheduler"? --yes--> built on the optimizer (schedulers.py), else None
    fz3.initialize(model, optimizer, settings.config, lr_scheduler) -> the engine
    training_data? --yes--> DataLoader(micro batch, DistributedSampler)

DeepSpeed: runtime/engine.py DeepSpeedEngine.__init__, _configure_optimizer,
_configure_lr_scheduler, deepspeed_io.
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional

import torch
import torch.distributed as dist
from torch import nn

from fz3.deepspeed.settings import Settings, read_settings


def build_engine(model: nn.Module, ds: Mapping[str, object], *, optimizer=None, model_parameters=None,
                 training_data=None, lr_scheduler=None, collate_fn: Optional[Callable] = None):
    """-> (engine, optimizer, dataloader or None, lr_scheduler or None)."""
    from fz3.api import initialize
    if not isinstance(model, nn.Module):
        raise TypeError(f"deepspeed.initialize expects an nn.Module as model, got {type(model).__name__}")
    settings = read_settings(ds, world_size=_world_size())
    optimizer = _optimizer(optimizer, settings, model, model_parameters)
    lr_scheduler = _lr_scheduler(lr_scheduler, settings, optimizer)
    engine = initialize(model, optimizer, settings.config, lr_scheduler=lr_scheduler)
    adopt(engine, settings)
    loader = None if training_data is None else dataloader(engine, training_data, collate_fn,
                                                           drop_last=settings.dataloader_drop_last)
    return engine, optimizer, loader, lr_scheduler


def adopt(engine, settings: Settings) -> None:
    """The engine takes what only the DeepSpeed config says: the batch sizes, the 16-bit
    save switch."""
    from fz3.shell.surface import BatchSizes
    engine.batch = BatchSizes(settings.train_batch_size, settings.train_micro_batch_size_per_gpu)
    engine.gather_16bit_weights_on_model_save = settings.gather_16bit_weights_on_model_save


def _world_size() -> int:
    from fz3.interpreters import threads
    transport = threads.current()
    if transport is not None:
        return transport.world_size
    return dist.get_world_size()


def _optimizer(optimizer, settings: Settings, model: nn.Module, model_parameters):
    params = list(model.parameters() if model_parameters is None else model_parameters)
    if optimizer is not None and settings.optimizer is not None:
        _client_and_json(optimizer, settings.optimizer)
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if optimizer is not None:
        if not callable(optimizer):
            raise TypeError(f"deepspeed.initialize: optimizer must be a torch.optim.Optimizer or a callable "
                            f"taking model_parameters, got {type(optimizer).__name__}")
        return optimizer(params)
    if settings.optimizer is None:
        raise ValueError("deepspeed.initialize: no optimizer: pass optimizer= (a torch optimizer) or put an "
                         "\"optimizer\": {\"type\": \"AdamW\", \"params\": {...}} section in the config "
                         "(ZeRO-3 training steps an optimizer on the fp32 master shards)")
    from fz3.deepspeed.optimizers import build_optimizer
    from fz3.shell.pick import pick_device
    return build_optimizer(settings.optimizer, params, fused=pick_device().type != "cpu")


def _client_and_json(optimizer, section: Mapping[str, object]) -> None:
    """A client optimizer and a JSON "optimizer" together: an error, as Accelerate's (and so the
    HF Trainer's) DeepSpeed path makes it. DeepSpeed 0.19.8 itself steps the client optimizer
    and ignores the section without a word (tests/data/deepspeed_facts_0.19.8.json), so the
    lr, betas and weight decay the JSON says would silently not be the ones trained with."""
    raise ValueError(f"deepspeed.initialize: an optimizer came both as optimizer= "
                     f"({type(optimizer).__name__}) and as the config's \"optimizer\" section "
                     f"({dict(section).get('type')!r}); pass one: remove the section or the argument")


def _lr_scheduler(lr_scheduler, settings: Settings, optimizer):
    if lr_scheduler is not None and settings.scheduler is not None:
        raise ValueError(f"deepspeed.initialize: an lr scheduler came both as lr_scheduler= "
                         f"({type(lr_scheduler).__name__}) and as the config's \"scheduler\" section "
                         f"({dict(settings.scheduler).get('type')!r}); pass one (DeepSpeed 0.19.8 silently "
                         "steps the argument and ignores the section; Accelerate refuses the pair)")
    if lr_scheduler is not None:
        if callable(lr_scheduler) and not callable(getattr(lr_scheduler, "step", None)):
            return lr_scheduler(optimizer)
        return lr_scheduler
    if settings.scheduler is None:
        return None
    from fz3.deepspeed.schedulers import build_scheduler
    return build_scheduler(settings.scheduler, optimizer)


def dataloader(engine, dataset, collate_fn: Optional[Callable] = None, *,
               drop_last: bool = False) -> torch.utils.data.DataLoader:
    """A DataLoader of train_micro_batch_size_per_gpu samples, this rank's part of the dataset
    (a DistributedSampler over the engine's ranks, shuffled with seed 0, as DeepSpeed's), the
    last short batch kept unless dataloader_drop_last. DeepSpeed: deepspeed_io,
    DeepSpeedDataLoader (which also starts 2 worker processes per device; fz3 loads in the
    training process: the same batches)."""
    if not isinstance(dataset, (torch.utils.data.Dataset, torch.utils.data.IterableDataset)):
        raise ValueError(f"deepspeed.initialize: training_data must be a torch Dataset, got "
                         f"{type(dataset).__name__}")
    sampler = None
    if not isinstance(dataset, torch.utils.data.IterableDataset):
        sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=engine.world_size, rank=engine.rank)
    return torch.utils.data.DataLoader(dataset, batch_size=engine.train_micro_batch_size_per_gpu(),
                                       sampler=sampler, collate_fn=collate_fn,
                                       drop_last=drop_last)
