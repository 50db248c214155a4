"""fz3's public entry points: `initialize(model, optimizer, cfg) -> Engine`, and `check(build)`,
which runs the user's model through initialize on thread ranks against one process."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from fz3.config.config import Config
from fz3.build import meta
from fz3.data.shards import shard_of
from fz3.shell import log, registry
from fz3.shell.optim import InferenceOnly
from fz3.shell.pick import check_group_backend, pick_device
from fz3.core import stage
from fz3.interpreters import groups, threads
from fz3.shell import hybrid
from fz3.interpreters.dist import DistInterpreter
from fz3.interpreters.transport import Transport, TorchTransport
from fz3.io import optimizer_state
from fz3.io.engine_methods import ValueMovers
from fz3.shell import engine as lifecycle
from fz3.config.options import Options, given
from fz3.checking.report import CheckReport


class Engine(ValueMovers, lifecycle.Engine):
    """What `fz3.initialize` returns: the shell's engine (the lifecycle, DeepSpeed's engine
    surface) with the methods that move values in and out (fz3/io/engine_methods.py)."""


def initialize(model: nn.Module, optimizer: torch.optim.Optimizer | None, config: Config | None = None,
               lr_scheduler=None, *, group=None, options: Options | None = None, mesh=None) -> Engine:
    """Shard `model` over the default process group and rebind `optimizer` (built on
    model.parameters()) to this rank's fp32 master shards; None: an engine that only runs forwards
    (a frozen reference model: its step refuses, fz3/shell/optim.py InferenceOnly). Every rank
    must call it.
    `lr_scheduler` (built on `optimizer`) is stepped by `engine.step()` at each accumulation
    boundary, after the optimizer. `options`: fz3's own switches outside DeepSpeed's vocabulary
    (the gloo carriers, debug checks; fz3/config/options.py).
    Inside fz3.launch.run_threads the rank is a thread of one process: the thread's transport
    (fz3/interpreters/threads.py) stands in for the process group.
    `mesh`: FSDP2's 2-D DeviceMesh (replicate, shard) for hybrid sharding, the same as
    Config(shard_group_size=mesh.size(1)) ([Note: hybrid sharding], fz3/core/stage.py).
    DeepSpeed: deepspeed.initialize(model=..., optimizer=..., config=...) at stage 3."""
    if config is None:
        config = Config()
    if not isinstance(config, Config):
        raise TypeError(f"fz3.initialize expects a fz3.Config (use Config.from_deepspeed for a "
                        f"DeepSpeed dict), got {type(config).__name__}")
    options = given(options, "fz3.initialize")
    if not isinstance(model, nn.Module):
        raise TypeError(f"fz3.initialize expects an nn.Module, got {type(model).__name__}")
    if optimizer is None:  # a frozen, inference-only engine (fz3/shell/optim.py)
        optimizer = InferenceOnly(model.parameters())
    transport = threads.current()
    if transport is None and not dist.is_initialized():
        raise RuntimeError("fz3.initialize needs torch.distributed initialised (fz3.launch.run or "
                           "torchrun + fz3.launch.init_from_env), or a rank of fz3.launch.run_threads")
    if transport is not None and group is not None:
        raise ValueError("fz3.initialize: group= is for process groups; a rank of fz3.launch.run_threads "
                         f"has its thread world's transport (got group={group!r})")
    taken = registry.managed(model.parameters())
    if taken is not None:
        name = next(n for n, p in model.named_parameters() if p is taken)
        raise RuntimeError(f"fz3.initialize: {type(model).__name__} already has an fz3 engine (its "
                           f"param {name!r} is sharded by it); keep using that engine, or build a "
                           "fresh model for a new one")
    device = pick_device()
    if transport is None:
        check_group_backend(device, group)
        transport = TorchTransport(group)
    elif device.torch_device.type != "cpu":
        raise RuntimeError(f"fz3.launch.run_threads runs on CPU only; this rank picked {device.torch_device} "
                           "(set FZ3_DEVICE=cpu)")
    if mesh is not None:
        config = config.replace(shard_group_size=hybrid.from_mesh(mesh, config, transport.world_size))
    stage.layout_world(config, transport.world_size)  # a group size that does not divide the world: its error
    axes = groups.axes(transport, config.shard_group_size, stage.secondary_world(config, transport.world_size))
    if axes is None or axes.replica is None:  # flat: under torchrun on several nodes, say how to keep gathers on one
        log.flat_across_nodes(transport.rank, transport.world_size, config)
    device.set_device()
    if meta.has_meta(model):  # built on torch.device("meta"): one module at a time (meta.py)
        if isinstance(transport, threads.ThreadTransport):
            raise ValueError("fz3.initialize: a model built on the meta device needs a process group "
                             "(fz3.launch.run), not fz3.launch.run_threads")
        meta.materialize(model, device.torch_device, group)
    _to_device(model, device.torch_device)
    _sync_from_rank0(model, transport)
    engine = Engine(model, optimizer, config, device=device, rank=transport.rank,
                    world_size=transport.world_size, transport=transport, lr_scheduler=lr_scheduler,
                    options=options,
                    interpreter=lambda store: DistInterpreter(store, config=config, device=device,
                                                              transport=transport, options=options,
                                                              training=lambda: model.training, axes=axes))
    optimizer_state.install(engine)  # optimizer.state_dict() / load_state_dict(): unsharded, or an error
    registry.register(engine)
    log.initialized(engine)
    return engine


def _to_device(model: nn.Module, device: torch.device) -> None:
    """model.to(device), except params built under fz3.Init: their shards go to the device when
    the engine takes them, and their placeholders stay (moving one would make it whole)."""
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None and shard_of(p) is None:
                p.data = p.data.to(device)
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = b.to(device)


def _sync_from_rank0(model: nn.Module, transport: Transport) -> None:
    """Every rank starts from rank 0's values (DeepSpeed's zero.Init broadcasts them too); params
    built under fz3.Init already hold shards of rank 0's values."""
    whole = [p for p in model.parameters() if shard_of(p) is None]
    for t in whole + list(model.buffers()):
        transport.broadcast(t.data, src=0)


def check(build, *, world_sizes=(1, 2, 3), examples: int = 12, steps: int = 2, config=None, seed: int = 0,
          options: Options | None = None, optimizer="sgd", rtol: float = 1e-5, atol: float = 1e-6,
          bf16: bool = False) -> CheckReport:
    """Does the model `build()` makes train the same on N ranks as in one process, under configs
    drawn around `config` (a fz3.Config, or a DeepSpeed dict for Config.from_deepspeed)?
    `build()` returns (model, example_batches, loss_fn), loss_fn(model, batch) -> scalar loss,
    or (model, example_inputs), the loss then derived from the output (fz3/checking/build.py).
    `examples` examples, each `steps` optimizer steps on one of `world_sizes` thread ranks
    (fz3.launch.run_threads) against one process doing fz3's arithmetic, then checked: losses,
    params (rtol, atol; looser with bf16 compute, drawn only when `bf16` or `config` says so),
    buffers, I1, I2, determinism, divergence. A failing example is shrunk to the smallest that
    still fails. `options`: the fz3.Options the run will use; `optimizer`: "sgd" (momentum 0.9,
    lr 1e-2), "adamw", "adam" or callable(params). -> CheckReport (.ok, .failures, .summary()).
    Bad input raises fz3.checking.build.CheckInputError (a ValueError) naming what was
    expected. `python -m fz3 check MODULE:FUNCTION` is the same from the command line
    (docs/check.md)."""
    from fz3.checking.check import Settings, check as run_check
    if isinstance(config, dict):
        config = Config.from_deepspeed(config)
    settings = Settings(world_sizes=tuple(world_sizes) if isinstance(world_sizes, (list, tuple)) else world_sizes,
                        examples=examples, steps=steps, config=Config() if config is None else config, seed=seed,
                        options=Options() if options is None else options, optimizer=optimizer, rtol=rtol,
                        atol=atol, bf16=bf16)
    return run_check(build, settings, initialize=initialize)
