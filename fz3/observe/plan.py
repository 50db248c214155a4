"""fz3.plan: what a run will do, per step and per rank, before it runs.

    p = fz3.plan(model, cfg, world_size=64, example_inputs=(x,))   # no process group, no data
    print(p)                # the table: gathers, bytes moved, buckets, peak live, resident bytes
    p.steps[i]              # per optimizer step (per rank: every rank runs the same effects)
    p.stats                 # the keys of engine.stats() the plan can know, after the planned steps
    p.guesses               # the data-dependent values the model read that had to be guessed

How: the real engine (hooks, core, every decision) runs as rank 0 of `world_size` on a fake copy
of the model (fz3/observe/fake.py: fake tensors under FakeTensorMode, shapes and no memory; the
user's model is not touched) with the planning interpreter
(fz3/interpreters/planned.py), which counts each effect as the real interpreter does
(fz3/interpreters/accounting.py). For a model whose call order does not depend on the data, the
counts and bytes equal engine.stats() after the same steps of a real run (tests/test_plan.py).
What the model reads of its data (`.item()`, `if mask.any():`, nonzero) is computed where its
value follows from the inputs, the buffers and constants, and guessed where it follows from
the params: each guess is listed in the table and in `Plan.guesses`.

The example inputs are one micro-batch: positional args (a tuple), keyword args (a dict) or one
tensor. Trailing positional args that model.forward does not take are targets and are not passed
(`example_inputs=(x, y)` for a model called as model(x)). The loss the plan backpropagates is
the output's `.loss` (Hugging Face), a scalar output, or else the sum of every floating output:
any of them reaches the same params, which is all that the counts depend on.

Not planned: activations, the CPU buffer pool's cache, the process's memory, time. The optimizer
state is measured on two tiny real probes of the same optimizer (bytes = a + b x numel per
param), so any torch optimizer, or a factory for one, is planned exactly.
"""
from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Union

import torch
from torch import nn

from fz3.core import calls
from fz3.core.grad import grads
from fz3.config.config import Config, differences
from fz3.config.options import given
from fz3.shell import registry
from fz3.shell.compiled import PROCESS_WIDE
from fz3.observe import offload_plan
from fz3.observe.fake import Fakes, Guess
from fz3.shell.memory import human_bytes
from fz3.shell.hooks import flatten

OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}
NOT_PLANNED = ("pool_bytes", "device_allocated_bytes", "device_peak_bytes", *PROCESS_WIDE)
"""engine.stats() keys that are runtime, not decided by the core (the compiler's counts are the
process's): the plan leaves them out."""
STEP_COUNTS = ("all_gather", "all_gather_on_demand", "all_gather_prefetch", "gathered_bytes",
               "reduce", "reduced_bytes", "bytes_intra_group", "bytes_inter_group", "messages_intra_group",
               "messages_inter_group", "all_gather_hpz")


@dataclass
class Plan:
    world_size: int
    backend: str
    config: Config
    params: int  # elements of the model (a tied param once)
    persistent_params: int  # elements of the params never sharded (param_persistence_threshold)
    steps: list[dict[str, int]] = field(default_factory=list)  # per optimizer step, per rank
    stats: dict[str, Any] = field(default_factory=dict)  # engine.stats() keys, after the steps
    guesses: list[Guess] = field(default_factory=list)  # data-dependent values the model read, guessed
    # optimizer offload (fz3/observe/offload_plan.py): the last step's figures, the memory a rank
    # was given (device_memory) and whether the plan fits it; `chosen` the config the planner
    # chose to fit it (offload_optimizer's ratio), or None where it chose nothing
    offload: Any = None
    device_memory: int | None = None
    fits: bool | None = None
    chosen: Config | None = None
    searched: bool = False  # device_memory did not fit and the planner looked for a ratio that does
    host_step: bool = False  # an accelerator's optimizer steps on the host: model states are the device's

    def table(self) -> str:
        """The plan as a text table, per rank, one column per step."""
        return _table(self)

    def __str__(self) -> str:
        return self.table()


def plan(model: nn.Module, config: Config | None = None, *, world_size: int, example_inputs,
         optimizer: Union[str, Callable[..., torch.optim.Optimizer]] = "adamw", steps: int = 1,
         backend: str | None = None, options=None, device_memory: int | None = None,
         ranks_per_node: int | None = None) -> Plan:
    """Plan `steps` optimizer steps of `model` under `config` on `world_size` ranks, each of
    config.gradient_accumulation_steps forward and backward passes on `example_inputs`.
    `optimizer`: "adamw", "adam", "sgd" or a callable that builds a torch optimizer from params;
    `backend`: the one to plan for (gloo, nccl, hccl; None: what fz3.initialize would pick here);
    `options`: the fz3.Options the run will use (its gloo carriers change what moves).
    `device_memory`: the bytes a rank has for its model states: the plan says whether it fits,
    and, the config offloading nothing, chooses the share of the optimizer to offload to NVMe
    (offload_optimizer's ratio, as DeepSpeed picks the sub-groups) that makes it fit (`chosen`;
    a config that offloads already is planned as it is: its ratio is honoured).
    `ranks_per_node`: the nodes of a flat run, for its bytes on each link (bytes_intra_group,
    bytes_inter_group; under hybrid sharding the shard groups are the link groups)."""
    config = Config() if config is None else config
    options = given(options, "fz3.plan")
    _check(model, config, world_size, optimizer, steps, backend)
    if ranks_per_node is not None and (isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int)
                                       or ranks_per_node < 1 or world_size % ranks_per_node):
        raise ValueError(f"fz3.plan: ranks_per_node must be an int >= 1 that divides world_size={world_size} "
                         f"(the ranks of each node), got {ranks_per_node!r}")
    if device_memory is not None and (isinstance(device_memory, bool) or not isinstance(device_memory, int)
                                      or device_memory <= 0):
        raise ValueError(f"fz3.plan: device_memory must be a number of bytes > 0, got {device_memory!r}")
    out = _plan(model, config, world_size, example_inputs, optimizer, steps, backend or _default_backend(),
                options, device_memory, ranks_per_node=ranks_per_node)
    if device_memory is None or out.fits or config.offload_optimizer.device == "nvme" or config.stage != 3:
        return out  # fits, offloads as the user said, or a stage DeepSpeed puts no optimizer on NVMe at
    trial = config.replace(offload_optimizer=dataclasses.replace(
        config.offload_optimizer, device="nvme", nvme_path=config.offload_optimizer.nvme_path or "NVME_PATH"))
    offloaded = _plan(model, trial, world_size, example_inputs, optimizer, steps, backend or _default_backend(),
                      options, device_memory, search=True, ranks_per_node=ranks_per_node)
    if offloaded.chosen is not None:
        return offloaded
    out.searched = True
    return out


def _plan(model, config, world_size, example_inputs, optimizer, steps, backend, options, device_memory,
          search: bool = False, ranks_per_node: int | None = None) -> Plan:
    fakes = Fakes(model)
    args, kwargs = bind_inputs(fakes.model, example_inputs)
    with fakes:
        engine = _engine(fakes.model, config, world_size, backend, options, ranks_per_node)
    state_rate = _optimizer_state_rate(optimizer)  # on real probes
    with fakes:
        args, kwargs = fakes.inputs(args, kwargs)
        out = _run(engine, fakes, args, kwargs, steps, state_rate, device_memory, search)
    out.guesses = fakes.guesses()
    return out


def _engine(shadow: nn.Module, config: Config, world_size: int, backend: str, options,
            ranks_per_node: int | None = None):
    """The real engine on the fake copy, as rank 0 of `world_size`, with the planning interpreter."""
    from fz3.interpreters.planned import PlanInterpreter
    from fz3.shell.device import MetaDevice
    from fz3.shell.engine import Engine
    return Engine(shadow, torch.optim.SGD(shadow.parameters(), lr=0.0), config, device=MetaDevice(backend),
                  rank=0, world_size=world_size, options=options,
                  interpreter=lambda store: PlanInterpreter(store, config=config, backend=backend, options=options,
                                                            world_size=world_size, ranks_per_node=ranks_per_node))


def _run(engine, fakes, args: tuple, kwargs: dict, steps: int, state_rate: tuple[int, int],
         device_memory: int | None = None, search: bool = False) -> Plan:
    """Run the planned steps and read each one's figures off the interpreter's counts and peaks
    (each peak restarted at the step's start). A model that raises gets the guesses made so far
    as a note (a branch taken on a guess may be why). The optimizer keeps state for the params
    it has stepped: the trainable ones that got a grad in some window so far ([Note: no grad,
    no step])."""
    config, interp, spec = engine.config, engine.interp, engine.spec
    out = Plan(engine.world_size, engine.accelerator.backend, config, params=sum(p.numel for p in spec.params),
               persistent_params=sum(p.numel for p in spec.params if p.persistent))
    stepped = set()
    trainable = {p for p, t in enumerate(engine.store.trainable) if t}
    try:
        for _ in range(steps):
            before = dict(interp.counts)
            interp.peak_held_bytes, interp.peak_live_numel = interp.held_bytes, interp.live_numel  # this step's peaks
            interp.peak_grad_bytes, interp.peak_joint = interp.grad_bytes, interp.joint_bytes()
            interp.peak_secondary_bytes = interp.secondary_bytes
            for micro in range(config.gradient_accumulation_steps):
                loss = _loss(engine(*args, **kwargs))
                with fakes.backward():
                    engine.backward(loss)
                if micro < config.gradient_accumulation_steps - 1:
                    engine.step()  # off the boundary, as a DeepSpeed loop steps every micro-step
            stepped |= trainable - set(calls.no_grad_params(engine.state))
            state_bytes = _state_bytes(state_rate, engine.store, stepped)
            waiting = sum(spec.params[p].numel for p in grads.waiting(engine.state.grads)) \
                * engine.store.dtype.itemsize  # stages 0, 1: the window's grads whole in .grad
            engine.step()
            out.steps.append(_step_figures(engine, interp.counts, before, state_bytes, out.persistent_params, waiting))
    except Exception as e:
        if fakes.guesses():
            e.add_note("fz3.plan guessed, before this: " + "; ".join(map(str, fakes.guesses())))
        raise
    out.stats = _stats(engine, _state_bytes(state_rate, engine.store, stepped))
    if config.offload_optimizer.device == "nvme":
        ratio = config.offload_optimizer.ratio
        if search:  # the smallest share of the sub-groups to offload that fits
            n = offload_plan.figures(engine, state_rate, stepped).subgroups
            ratio = offload_plan.choose(lambda r: offload_plan.offloaded(out.steps[-1], offload_plan.figures(
                engine, state_rate, stepped, r), engine)["model_state_peak_bytes"], n, device_memory)
            if ratio is None:
                return out
            out.chosen = config.replace(offload_optimizer=dataclasses.replace(config.offload_optimizer, ratio=ratio))
            out.config = out.chosen
        out.offload = offload_plan.figures(engine, state_rate, stepped, ratio)
        out.steps = [offload_plan.offloaded(s, out.offload, engine) for s in out.steps]
    if config.offload_param.device == "nvme" and engine.store.separate:
        out.steps = [offload_plan.param_files(s, engine) for s in out.steps]
    if config.offload_optimizer.device != "none" and out.backend != "gloo":
        out.host_step = True
        on_disk = out.offload.masters_offloaded if out.offload is not None else 0
        out.steps = [offload_plan.host_step(s, engine, on_disk) for s in out.steps]
    if device_memory is not None:
        out.device_memory = device_memory
        out.fits = all(s["model_state_peak_bytes"] <= device_memory for s in out.steps)
    return out


def _step_figures(engine, counts, before: dict, state_bytes: int, persistent: int, waiting: int = 0
                  ) -> dict[str, int]:
    """One step's row of the table: what moved during it, and the model states at its peak.
    `waiting`: the whole grads in param.grad at the window's end (stages 0 and 1: [Note: grads
    at the boundary], fz3/core/grad/grads.py), beside every other model state then."""
    elem, interp = engine.store.dtype.itemsize, engine.interp
    peak = interp.peak_live_numel
    stats = _stats(engine, state_bytes)
    step = {k: counts[k] - before.get(k, 0) for k in STEP_COUNTS}
    step.update(peak_live_numel=peak, peak_live_bytes=peak * elem, param_shards=stats["param_shards"],
                grad_partitions=interp.peak_grad_bytes, optimizer_state_bytes=state_bytes,
                persistent_param_bytes=persistent * elem, buffer_bytes=stats["buffer_bytes"],
                reduce_buffer_bytes=stats["reduce_buffer_bytes"], peak_held_grad_bytes=interp.peak_held_bytes,
                peak_transient_bytes=interp.peak_joint, waiting_grad_bytes=waiting,
                peak_secondary_bytes=interp.peak_secondary_bytes)
    # gathered params, grad partitions, held grads and hpZ's secondary shards come and go: the peak of their sum, not
    # the sum of their peaks (a backward frees gathered params as its grads' segments come)
    step["model_state_peak_bytes"] = (step["param_shards"] + state_bytes + step["reduce_buffer_bytes"]
                                      + step["buffer_bytes"] + interp.peak_joint + waiting)
    return step


def _stats(engine, state_bytes: int) -> dict[str, Any]:
    s = {k: v for k, v in engine.stats().items() if k not in NOT_PLANNED}
    s["optimizer_state_bytes"] = state_bytes  # the stand-in optimizer keeps none
    return s


def _check(model, config, world_size, optimizer, steps, backend) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"fz3.plan expects an nn.Module, got {type(model).__name__}")
    if not isinstance(config, Config):
        raise TypeError(f"fz3.plan expects a fz3.Config (Config.from_deepspeed for a DeepSpeed dict), "
                        f"got {type(config).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"fz3.plan: world_size must be an int >= 1, got {world_size!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"fz3.plan: steps must be an int >= 1, got {steps!r}")
    if not callable(optimizer) and optimizer not in OPTIMIZERS:
        raise ValueError(f"fz3.plan: optimizer must be one of {', '.join(OPTIMIZERS)} or a callable "
                         f"that builds a torch optimizer from params, got {optimizer!r}")
    if backend not in (None, "gloo", "nccl", "hccl"):
        raise ValueError(f"fz3.plan: backend must be gloo, nccl or hccl (None: this machine's), got {backend!r}")
    taken = registry.managed(model.parameters())
    if taken is not None:
        raise RuntimeError(f"fz3.plan: {type(model).__name__} is already sharded by an fz3 engine; plan "
                           "the model before fz3.initialize (or build another)")


def _default_backend() -> str:
    """The backend fz3.initialize would pick on this machine (fz3/shell/pick.py)."""
    from fz3.shell.pick import pick_device
    return pick_device().backend


def _optimizer_state_rate(optimizer) -> tuple[int, int]:
    """(a, b): the optimizer keeps a + b x numel bytes of state for a param it stepped, read off
    one step of the same optimizer on two real probes (1 and 2 elements)."""
    make = OPTIMIZERS.get(optimizer, optimizer) if isinstance(optimizer, str) else optimizer
    probes = [nn.Parameter(torch.zeros(n)) for n in (1, 2)]
    for p in probes:
        p.grad = torch.zeros_like(p)
    opt = make(probes, lr=1e-3) if isinstance(optimizer, str) else make(probes)
    opt.step()
    from fz3.shell.memory import tensor_bytes
    one, two = (tensor_bytes(v for v in opt.state[p].values() if isinstance(v, torch.Tensor)) for p in probes)
    return 2 * one - two, two - one


def _state_bytes(rate: tuple[int, int], store, params) -> int:
    """Bytes of optimizer state this rank holds for the fp32 master shards of `params`."""
    const, per_elem = rate
    return sum(const + per_elem * store.masters[p].numel() for p in params)


def bind_inputs(model: nn.Module, example_inputs, caller: str = "fz3.plan") -> tuple[tuple, dict]:
    """(args, kwargs), trailing positional args forward does not take dropped (fz3/observe/fake.py
    makes them fakes that keep their values). fz3.check calls a model on its example_inputs the
    same way; `caller` names the one asking in the errors."""
    if isinstance(example_inputs, dict):
        args, kwargs = (), dict(example_inputs)
    elif isinstance(example_inputs, (tuple, list)):
        args, kwargs = tuple(example_inputs), {}
    elif isinstance(example_inputs, torch.Tensor):
        args, kwargs = (example_inputs,), {}
    else:
        raise TypeError(f"{caller}: example_inputs must be a tuple of args, a dict of kwargs or a tensor, "
                        f"got {type(example_inputs).__name__}")
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):  # a builtin forward: pass everything
        sig = None
    if sig is not None and args:
        n = len(args)
        while n and not _binds(sig, args[:n], kwargs):
            n -= 1  # a trailing target the model does not take
        if not n and not _binds(sig, (), kwargs):
            raise TypeError(f"{caller}: {type(model).__name__}.forward{sig} cannot take example_inputs "
                            f"({len(args)} positional, keywords {sorted(kwargs)})")
        args = args[:n]
    return args, kwargs


def _binds(sig: inspect.Signature, args: tuple, kwargs: dict) -> bool:
    try:
        sig.bind(*args, **kwargs)
        return True
    except TypeError:
        return False


def _loss(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return out
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    leaves, _ = flatten(out)
    floats = [x for x in leaves if isinstance(x, torch.Tensor) and x.is_floating_point() and x.requires_grad]
    if not floats:
        raise ValueError("fz3.plan: the model's output has no floating tensor that requires grad, so "
                         "there is no backward to plan")
    return sum(x.float().sum() for x in floats)


ROWS = (("all-gathers", "all_gather"), ("  on demand", "all_gather_on_demand"),
        ("  prefetched", "all_gather_prefetch"), ("bytes gathered", "gathered_bytes"),
        ("reduce buckets", "reduce"), ("bytes reduced", "reduced_bytes"),
        ("peak live params (numel)", "peak_live_numel"), ("peak live params", "peak_live_bytes"),
        ("param shards (fp32 masters)", "param_shards"), ("grad partitions (peak)", "grad_partitions"),
        ("optimizer state", "optimizer_state_bytes"), ("persistent params (full)", "persistent_param_bytes"),
        ("module buffers", "buffer_bytes"), ("IPG bucket buffers", "reduce_buffer_bytes"),
        ("held grads (peak)", "peak_held_grad_bytes"), ("grads whole in .grad (stages 0, 1)", "waiting_grad_bytes"),
        ("hpZ secondary shards (peak)", "peak_secondary_bytes"),
        ("live + grads + held + secondary (peak together)", "peak_transient_bytes"),
        ("model states at the peak", "model_state_peak_bytes"))
OFFLOAD_ROWS = (("on disk (optimizer, params' shards)", "offloaded_bytes"), ("read from disk per step", "disk_read_bytes"),
                ("written to disk per step", "disk_written_bytes"),
                ("offloaded sub-groups in memory at once", "offload_working_bytes"),
                ("param shards read ahead of their gathers", "param_read_ahead_bytes"))
HOST_ROWS = (("host memory (masters, state, grads' copies)", "host_bytes"),)


STAGE_WORDS = {0: "params, grads and optimizer state whole on every rank",
               1: "optimizer state partitioned", 2: "grads and optimizer state partitioned",
               3: "params, grads and optimizer state partitioned"}  # fz3/core/stage.py


def _table(p: Plan) -> str:
    changed = [f"{k}={v!r}" for k, v in differences(p.config).items()]
    head = (f"fz3 plan: ZeRO stage {p.config.stage} ({STAGE_WORDS[p.config.stage]}), {p.params:,} params "
            f"({p.persistent_params:,} persistent) on {p.world_size} ranks, backend {p.backend}, compute "
            f"{p.config.compute_dtype}; config: {', '.join(changed) or 'defaults'}")
    names = [f"step {i + 1}" for i in range(len(p.steps))]
    width = max(len(r[0]) for r in ROWS)
    lines = [head, "per rank (every rank runs the same effects)", " " * width + "".join(f"{n:>16}" for n in names)]
    on_disk = bool(p.steps) and "disk_read_bytes" in p.steps[0]
    for label, key in ROWS + (OFFLOAD_ROWS if on_disk else ()) + (HOST_ROWS if p.host_step else ()):
        cells = [_fmt(key, s[key]) for s in p.steps]
        lines.append(f"{label:<{width}}" + "".join(f"{c:>16}" for c in cells))
    lines.append("model states at the peak = shards + optimizer state + bucket buffers + module buffers + the "
                 "peak of gathered params (persistent ones too) + grad partitions + held grads together + the "
                 "grads waiting whole for the boundary (activations not included)")
    if p.offload is not None:
        o = p.offload
        lines.append(f"offload_optimizer 'nvme', ratio {o.ratio:g}: {len(o.offloaded)} of {o.subgroups} sub-groups "
                     f"(sub_group_size {p.config.sub_group_size:,}) on disk between steps"
                     + (f", from the sub-group starting at {o.first_params[0]!r}" if o.first_params else "")
                     + "; the model states at the peak count the step's working set of them, not their bytes on disk")
    if p.device_memory is not None:
        worst = max(s["model_state_peak_bytes"] for s in p.steps)
        lines.append(f"device memory {human_bytes(p.device_memory)} a rank: the plan "
                     f"{'fits' if p.fits else 'does not fit'} (peak {human_bytes(worst)})"
                     + (f"; chosen to fit: offload_optimizer {{device: nvme, nvme_path: <your drive>, ratio: "
                        f"{p.chosen.offload_optimizer.ratio:g}}}" if p.chosen is not None else "")
                     + ("; no share of the optimizer on disk (offload_optimizer 'nvme') fits it either"
                        if p.searched else ""))
    if p.guesses:
        lines.append(f"guessed: {len(p.guesses)} data-dependent read(s) of values the plan does not have "
                     "(the figures hold if the run takes the same branches):")
        lines.extend(f"  {g}" for g in p.guesses)
    return "\n".join(lines)


def _fmt(key: str, v: int) -> str:
    if key.endswith("bytes") or key in ("param_shards", "grad_partitions"):
        return human_bytes(v)
    return f"{v:,}"
