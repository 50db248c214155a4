"""Parity of fz3 on N gloo ranks with single-process training (issue #4, invariant I7).

    results = run_world(world_size, models)          one fz3.launch.run: every (model, config)
                                                      pair in `models` x CONFIGS, one after the
                                                      other, inside the same N ranks
    ref = reference(model, world_size, optimizer)    plain torch, in the calling process

One launch per world size keeps the cost to one process start per rank (~10 s on a slow CPU);
each combination builds a fresh model, optimizer and engine on the process group already there.
A combination that raises is reported as its traceback (the ranks stay in step: fz3's core is
deterministic, so a failure in it fails on every rank at the same event).

What a rank returns per combination (`Result`): its loss at every micro-step, the consolidated
fp32 state dict, stats(), the fetch-unit sizes, the live-numel split of `LiveWatch` (I1 checked
after every event, not only after a prefetch), every NOT_AVAILABLE violation seen after a
step() call, and the experts each MoE pass used. A failure that is not the same on every rank
(a gloo size mismatch, a rank-local exception) ends the whole launch instead.

[Note: the reference] Each rank's loss is the mean over its own micro-batch; fz3 sums grads over
ranks and micro-steps and divides once by W * gas. The reference does the same arithmetic in one
process: per micro-step, the loss of each rank's slice, backward of loss / (W * gas), one
optimizer step per window. Before each window every grad is None (optimizer.zero_grad()'s
default), so a param that no rank used in the window keeps a None grad and the optimizer leaves
it alone; fz3 does the same ([Note: no grad, no step], fz3/core/grad/epilogue.py), where it once gave
it a zero grad partition, as DeepSpeed does (AdamW then decays it).
"""
from __future__ import annotations

import functools
import math
import traceback
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch
from torch import nn

from fz3.config.config import Config
from fz3.config.options import Options
from tests.support.live_watch import LiveWatch, unit_bounds
from tests.support.parity_models import MODELS, rank_slice

STEPS = 5  # optimizer steps per combination
GAS = 2  # gradient accumulation steps

DS_CONFIG = {  # a real DeepSpeed dict: stage 3, DeepSpeed defaults, clipping on
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": GAS,
    "gradient_clipping": 0.5,
    "steps_per_print": 10,
    "zero_optimization": {"stage": 3},
}

# Named configs; every model runs each of CONFIGS, "gpt" also those EXTRA names. Together they cover,
# for every model: prefetch on (base, tiny, bf16) and off (sync_allreduce), tiny prefetch (tiny),
# overlap on / off, both reduce paths, each gloo carrier of the reduce_scatter path (fz3's p2p in
# base and ds_defaults, the all-reduce one with grads not contiguous in tiny, gloo's own in bf16)
# and of the all-gather (p2p in base, ds_defaults and, without overlap, sync_allreduce; gloo's
# own in tiny; the all-reduce one in bf16), contiguous_gradients off (tiny), a reduce bucket
# smaller than most single grads (sync_allreduce, tiny), a tiny live budget (tiny), reuse
# distance 0 (sync_allreduce), persistence off (threshold 0) and bf16 compute. The optimizer is
# AdamW, but SGD with momentum where OPTIMIZERS says (see optimizer_for).
_C = dict(gradient_accumulation_steps=GAS)
CONFIGS: dict[str, Config] = {
    "base": Config(param_persistence_threshold=0, **_C),
    "sync_allreduce": Config(param_persistence_threshold=0, prefetch_bucket_size=0,
                             overlap_comm=False, reduce_scatter=False, reduce_bucket_size=7,
                             max_reuse_distance=0, **_C),
    "tiny": Config(param_persistence_threshold=2, prefetch_bucket_size=16, max_live_parameters=24,
                   reduce_bucket_size=7, contiguous_gradients=False, **_C),
    "bf16": Config(param_persistence_threshold=0, compute_dtype="bf16", prefetch_bucket_size=40,
                   reduce_bucket_size=64, **_C),
}
# fz3's own switches per named config: the gloo carriers (fz3/interpreters/carriers.py) and the
# core's invariants after every event (all but ds_defaults)
CHECKED = Options(debug_checks=True)
OPTIONS: dict[str, Options] = {
    "tiny": CHECKED.replace(gloo_all_gather="native", gloo_reduce_scatter="all_reduce"),
    "bf16": CHECKED.replace(gloo_all_gather="all_reduce", gloo_reduce_scatter="native"),
    "bf16_comm_fp32": CHECKED.replace(gloo_all_gather="all_reduce", gloo_reduce_scatter="p2p"),
    "ds_defaults": Options(),
}
EXTRA = {"gpt": ("ds_defaults", "bf16_comm_fp32", "prescale")}
# ds_defaults: DeepSpeed defaults (everything persistent), from_deepspeed. The other two, gpt
# only, check the grad scalings DeepSpeed keys ask for, on each way a grad reaches a reduce.
# bf16_comm_fp32: the bf16 config reducing in fp32 (communication_data_type: the same reduces
# moving twice the bytes, tests/test_parity.py) with a gradient_predivide_factor, on the p2p
# carrier (grads held, cast and divided in place) and from param.grad (grads bigger than the
# bucket). prescale: prescale_gradients on the all-reduce path (the flat bucket divided in place)
# and from param.grad.
EXTRA_CONFIGS: dict[str, Config] = {
    "bf16_comm_fp32": CONFIGS["bf16"].replace(communication_data_type="fp32", gradient_predivide_factor=3.0),
    "prescale": Config(param_persistence_threshold=0, prescale_gradients=True, reduce_scatter=False,
                       reduce_bucket_size=64, **_C),
}


# hybrid sharding and hpZ (issue #49) on 6 ranks as 3 groups of 2 and as 2 groups of 3
# (tests/test_hybrid_sharding.py): the p2p carriers and DeepSpeed's defaults (every param
# sharded, AdamW), bf16 with clipping (SGD), the all-reduce path within the groups
HYBRID_CONFIGS: dict[str, Config] = {
    "hybrid": Config(param_persistence_threshold=0, shard_group_size=2, **_C),
    "hybrid_bf16_clip": CONFIGS["bf16"].replace(shard_group_size=2, gradient_clipping=0.5),
    "hybrid_allreduce": Config(param_persistence_threshold=0, shard_group_size=2, reduce_scatter=False,
                               reduce_bucket_size=64, **_C),
    "hybrid3": Config(param_persistence_threshold=0, shard_group_size=3, **_C),
    "hybrid3_bf16_clip": CONFIGS["bf16"].replace(shard_group_size=3, gradient_clipping=0.5),
    # hpZ (issue #49, tests/test_hpz.py): 6 flat ranks with secondary shards in groups of 2, and
    # of 3 in bf16 with clipping
    "hpz": Config(param_persistence_threshold=0, zero_hpz_partition_size=2, **_C),
    "hpz3_bf16_clip": CONFIGS["bf16"].replace(zero_hpz_partition_size=3, gradient_clipping=0.5),
}


def config_named(name: str) -> Config:
    if name in HYBRID_CONFIGS:
        return HYBRID_CONFIGS[name]
    if name == "ds_defaults":
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "accepts but does not use: steps_per_print, ..."
            return Config.from_deepspeed(DS_CONFIG)
    return CONFIGS[name] if name in CONFIGS else EXTRA_CONFIGS[name]


def options_named(name: str) -> Options:
    return OPTIONS.get(name, CHECKED)


def configs_for(model: str) -> tuple[str, ...]:
    return tuple(CONFIGS) + EXTRA.get(model, ())


OPTIMIZERS = {"sync_allreduce": "sgd", "bf16": "sgd", "bf16_comm_fp32": "sgd", "prescale": "sgd",
              "hybrid_bf16_clip": "sgd", "hybrid3_bf16_clip": "sgd", "hpz3_bf16_clip": "sgd"}  # the others: "adamw"


def optimizer_for(config_name: str) -> str:
    """AdamW, or SGD with momentum where Adam would hide or amplify an error: Adam is invariant
    to the scale of the grads (a wrong divisor barely shows), and its first steps (lr * sign(g))
    turn bf16 rounding of near-zero grads into whole lr-sized differences."""
    return OPTIMIZERS.get(config_name, "adamw")


def make_optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    """Two param groups, as training scripts make them: matrices, and 1-D / 0-D params (biases,
    norms) with their own options (AdamW: no weight decay; SGD: half the lr). fz3 must keep each
    group's options on its shards."""
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    if kind == "adamw":
        groups = [{"params": matrices}, {"params": vectors, "weight_decay": 0.0}]
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=5e-3, eps=1e-6, weight_decay=0.01)
    groups = [{"params": matrices}, {"params": vectors, "lr": 0.025}]
    return torch.optim.SGD([g for g in groups if g["params"]], lr=0.05, momentum=0.9)


def make_scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """The learning rate decays at every optimizer step: a scheduler stepped at the wrong time
    (every micro-step, or never) changes the params."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + 0.3 * step))


# Forward-only passes inserted before the training forward of these micro-steps (and after the
# last step): before any step, between two micro-steps of one window, between windows, after
# training. Each is compared with the reference's loss on the same weights, and training must go
# on unchanged (issue #10).
EVALS = {0: "inference_mode", 3: "no_grad_eval", 4: "eval_with_grad", STEPS * GAS: "inference_mode"}
RAISE_AT = 5  # before this micro-step's training forward, a forward that raises midway


class InjectedError(RuntimeError):
    """The error a forward pre-hook raises in the second submodule call of a pass."""


def device() -> torch.device:
    """Where this process trains: the device fz3 picks (FZ3_DEVICE, else NPU, CUDA, CPU). The
    reference trains there too, so a CUDA run compares CUDA kernels with CUDA kernels."""
    from fz3.shell.pick import pick_device
    return pick_device().torch_device


def on(batch: tuple, where: torch.device) -> tuple:
    return tuple(t.to(where) for t in batch)


def cpu_state(state: dict) -> dict:
    """A state dict on the CPU, dtypes kept: what a rank sends back and the tests compare."""
    return {k: v.cpu() for k, v in state.items()}


def evaluate(m, net: nn.Module, spec, batch: tuple, i: int, how: str) -> float:
    """One forward-only pass of `m` (an engine or a plain model whose module is `net`)."""
    if how == "inference_mode":
        with torch.inference_mode():
            return spec.loss(m, batch, i).item()
    net.eval()
    try:
        if how == "no_grad_eval":
            with torch.no_grad():
                return spec.loss(m, batch, i).item()
        return spec.loss(m, batch, i).item()  # eval_with_grad: a graph no backward will use
    finally:
        net.train()


def raise_midway(engine, net: nn.Module, spec, batch: tuple, i: int) -> None:
    """A forward that raises on every rank inside the pass (a shape error in one block): the
    second submodule call raises after fz3's pre-forward fetched its params."""
    calls: list[nn.Module] = []

    def hook(module, args):
        calls.append(module)
        if len(calls) == 2:
            raise InjectedError("injected error in the second submodule call")

    handles = [m.register_forward_pre_hook(hook) for m in net.modules() if m is not net]
    try:
        spec.loss(engine, batch, i)
    except InjectedError:
        pass
    else:
        raise AssertionError("the injected error was never raised (fewer than 2 submodule calls)")
    finally:
        for h in handles:
            h.remove()


@dataclass
class Result:
    losses: list[float] = field(default_factory=list)  # this rank's loss per micro-step
    state: dict = field(default_factory=dict)  # full_state_dict() after the last step
    stats: dict = field(default_factory=dict)
    units: list[int] = field(default_factory=list)  # numel of each module's fetch unit (+externals)
    chains: list[int] = field(default_factory=list)  # per module: unit numels summed root..module
    persistent_numel: int = 0
    not_available: list[str] = field(default_factory=list)  # violations after step()
    budget_max: int = 0  # most live numel no active module, hold, persistence or external pinned
    pinned_max: int = 0  # most live numel that was pinned so
    observed_peak: int = 0  # most live numel seen after any parameter event
    peak_detail: str = ""  # what was live at the observed peak
    experts: list[tuple] = field(default_factory=list)  # moe: experts used per micro-step
    eval_losses: list[float] = field(default_factory=list)  # this rank's, at EVALS, in order
    grad_norms: list[float] = field(default_factory=list)  # get_global_grad_norm() per step
    lrs: list[list[float]] = field(default_factory=list)  # get_lr() after each step
    train_prefetch: int = 0  # params prefetched in training passes (not in forward-only ones)
    train_trace: str = ""  # trace mode after the last training step
    error: Optional[str] = None


# ---- the rank side -------------------------------------------------------------------------------

def worker(rank: int, world_size: int, models: tuple[str, ...], probes: bool,
           configs: Optional[tuple[str, ...]] = None) -> dict:
    """Every (model, config) of `models` in this process group (`configs`, or each model's
    configs_for), then the API probes."""
    torch.manual_seed(0)
    out: dict = {}
    for model in models:
        for cname in configs if configs is not None else configs_for(model):
            try:
                out[(model, cname)] = train(model, cname, rank, world_size)
            except Exception:  # noqa: BLE001 - reported per combination, see the module doc
                out[(model, cname)] = Result(error=traceback.format_exc())
    if probes:
        try:
            out["probes"] = api_probes(rank, world_size)
        except Exception:  # noqa: BLE001
            out["probes"] = {"error": traceback.format_exc()}
    return out


def _engine(model: str, config: Config, optimizer: str, options: Options = CHECKED):
    import fz3
    spec = MODELS[model]
    net = spec.build()
    if spec.leaf_classes:
        fz3.set_leaf_modules(net, spec.leaf_classes)
    opt = make_optimizer(optimizer, net)
    return net, fz3.initialize(net, opt, config, make_scheduler(opt), options=options)


def train(model: str, config_name: str, rank: int, world_size: int) -> Result:
    spec = MODELS[model]
    net, engine = _engine(model, config_named(config_name), optimizer_for(config_name), options_named(config_name))
    res = Result()
    watch = LiveWatch(engine)
    where = device()
    for i in range(STEPS * GAS + 1):
        b = on(rank_slice(spec.batch(i), rank, world_size), where)
        if i in EVALS:
            res.eval_losses.append(evaluate(engine, net, spec, b, i, EVALS[i]))
        if i == STEPS * GAS:
            res.train_trace = engine.stats()["trace"]  # the training passes' trace, before the last eval
            break
        if i == RAISE_AT:
            raise_midway(engine, net, spec, b, i)
        before = engine.interp.counts["all_gather_prefetch"]
        loss = spec.loss(engine, b, i)
        engine.backward(loss)
        engine.step()
        res.train_prefetch += engine.interp.counts["all_gather_prefetch"] - before
        res.losses.append(loss.item())
        res.not_available += _check_released(engine, i)
        if (i + 1) % GAS == 0:  # step() stepped
            res.grad_norms.append(engine.get_global_grad_norm())
            res.lrs.append(engine.get_lr())
        if model == "moe":
            res.experts.append(net.moe.last_used)
    res.state = {k: v.float() for k, v in cpu_state(engine.full_state_dict()).items()}
    res.stats = engine.stats()
    res.units, res.chains = unit_bounds(engine)
    res.persistent_numel = sum(p.numel for p in engine.spec.params if p.persistent)
    res.budget_max, res.pinned_max, res.peak_detail = watch.budget_max, watch.pinned_max, watch.detail
    res.observed_peak = watch.peak
    return res


def _check_released(engine, i: int) -> list[str]:
    """After step(): every non-persistent param NOT_AVAILABLE (at a boundary, externals too)."""
    boundary = engine.optimizer_steps * GAS == i + 1
    bad = []
    for p, (ps, slot) in enumerate(zip(engine.spec.params, engine.params_state.params)):
        if ps.persistent or (slot.external and not boundary):
            continue
        status = engine.param_status(engine.tables.params[p])
        if status != "NOT_AVAILABLE":
            bad.append(f"micro-step {i}: {ps.name} is {status}")
    return bad


def api_probes(rank: int, world_size: int) -> dict:
    """gathered_parameters (modifier_rank 0 and None), full_state_dict keys, stats keys."""
    import fz3
    net, engine = _engine("gpt", CONFIGS["base"], "adamw")
    out = {"state_dict_keys": list(net.state_dict(keep_vars=True).keys()),
           "full_keys": list(engine.full_state_dict().keys()),
           "stats": engine.stats()}
    qkv = net.blocks[0].qkv.weight
    with fz3.gathered_parameters(net.blocks[0], modifier_rank=0):
        out["inside_shape"] = tuple(qkv.shape)
        out["inside_status"] = engine.param_status(qkv)
        if rank == 0:
            qkv.data.fill_(0.25)
            net.blocks[0].proj.bias.data.add_(1.0)
    out["after_modify"] = cpu_state(engine.full_state_dict())
    out["status_after"] = engine.param_status(qkv)
    with fz3.gathered_parameters([net.wte.weight, net.ln_f.bias], modifier_rank=None):
        net.wte.weight.data.mul_(rank + 2.0)
        net.ln_f.bias.data.fill_(float(rank))
    out["after_discard"] = cpu_state(engine.full_state_dict())
    spec = MODELS["gpt"]
    losses = []
    for i in range(GAS):  # the edited weights are the ones the next forward uses
        loss = spec.loss(engine, on(rank_slice(spec.batch(i), rank, world_size), device()), i)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    out["losses_after_edit"] = losses
    out["state_after_edit_step"] = cpu_state(engine.full_state_dict())
    return out


def run_world(world_size: int, models: tuple[str, ...], *, probes: bool = True,
              timeout: float = 600, threads: bool = False, configs: Optional[tuple[str, ...]] = None) -> dict:
    """One launch: -> rank 0's results; every rank's losses under key (model, config, 'losses').
    threads=True: the ranks are threads of this process (fz3.launch.run_threads). `configs`: the
    config names every model runs (None: its configs_for)."""
    from fz3 import launch
    args = (tuple(models), probes, configs)
    if threads:
        per_rank = launch.run_threads(worker, world_size, args=args, timeout_s=timeout)
    else:
        per_rank = launch.run(worker, world_size=world_size, args=args, timeout=timeout)
    out = per_rank[0]
    out["rank_losses"] = {k: [r[k].losses for r in per_rank] for k in out if isinstance(k, tuple)}
    out["rank_not_available"] = {k: sum((r[k].not_available for r in per_rank), [])
                                 for k in out if isinstance(k, tuple)}
    out["rank_experts"] = {k: [r[k].experts for r in per_rank] for k in out if isinstance(k, tuple)}
    out["rank_errors"] = {k: [r[k].error for r in per_rank if r[k].error] for k in out if isinstance(k, tuple)}
    out["rank_eval_losses"] = {k: [r[k].eval_losses for r in per_rank] for k in out if isinstance(k, tuple)}
    if probes:
        out["rank_probes"] = [r["probes"] for r in per_rank]
    return out


# ---- the reference -------------------------------------------------------------------------------

class Reference(NamedTuple):
    losses: list[list[float]]  # per micro-step, each rank's loss
    state: dict  # state_dict after the last step
    eval_losses: list[list[float]]  # per entry of EVALS (in order), each rank's loss
    grad_norms: list[float]  # per optimizer step, the norm before clipping
    lrs: list[list[float]]  # per optimizer step, each group's lr after it


def reference(model: str, world_size: int, optimizer: str, *, clip: float = 0.0,
              edit=None, steps: int = STEPS, evals: bool = True) -> Reference:
    """Single-process training with the same arithmetic, the same forward-only passes (`evals`)
    and the same param groups and lr scheduler. See [Note: the reference]. `edit(net)` changes
    weights before training."""
    spec = MODELS[model]
    where = device()
    net = spec.build()
    if edit is not None:
        edit(net)
    net.to(where)
    opt = make_optimizer(optimizer, net)
    sched = make_scheduler(opt)
    trainable = [p for p in net.parameters() if p.requires_grad]
    out = Reference([], {}, [], [], [])

    def forward_only(i: int) -> None:
        if evals and i in EVALS:
            out.eval_losses.append([evaluate(net, net, spec, on(rank_slice(spec.batch(i), r, world_size), where),
                                             i, EVALS[i]) for r in range(world_size)])

    for step in range(steps):
        for p in trainable:
            p.grad = None
        for i in range(step * GAS, (step + 1) * GAS):
            forward_only(i)
            batch = on(spec.batch(i), where)
            per_rank = []
            for r in range(world_size):
                loss = spec.loss(net, rank_slice(batch, r, world_size), i)
                (loss / (world_size * GAS)).backward()
                per_rank.append(loss.item())
            out.losses.append(per_rank)
        out.grad_norms.append(nn.utils.clip_grad_norm_(trainable, clip if clip > 0 else math.inf).item())
        opt.step()
        sched.step()
        out.lrs.append([g["lr"] for g in opt.param_groups])
    forward_only(steps * GAS)
    out.state.update(cpu_state({k: v.detach().clone() for k, v in net.state_dict().items()}))
    return out


# ---- the comparison -------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def cached_reference(model: str, world_size: int, optimizer: str, clip: float) -> Reference:
    """`reference`, once per arguments, with one intra-op thread as the ranks compute."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return reference(model, world_size, optimizer, clip=clip)
    finally:
        torch.set_num_threads(threads)


def max_dev(got: torch.Tensor, exp: torch.Tensor) -> tuple[float, float]:
    """(max abs deviation, max relative deviation where |exp| > 1e-3)."""
    d = (got - exp).abs()
    big = exp.abs() > 1e-3
    rel = (d[big] / exp.abs()[big]).max().item() if big.any() else 0.0
    return (d.max().item() if d.numel() else 0.0), rel


def assert_trains_as(res: dict, key: tuple, ref: Reference, loss_tol: dict, param_tol: dict,
                     where: str) -> tuple[tuple[float, float], float, float]:
    """A (model, config) of run_world's `res` against the one-process `ref`: every rank's loss at
    every micro-step, the forward-only passes' losses (inference_mode, no_grad + eval(), eval()
    with grad, before, between and after steps: training around them unchanged), the global
    grad norm before clipping, the lr scheduler stepped once per boundary with each group's own
    lr, and every param after the last step. -> (loss deviation, param abs, param rel)."""
    r = res[key]
    got = torch.tensor(res["rank_losses"][key], dtype=torch.float64).T  # (micro-step, rank)
    exp = torch.tensor(ref.losses, dtype=torch.float64)
    torch.testing.assert_close(got, exp, **loss_tol, msg=lambda m: f"{where}: losses\n{m}")
    loss_dev = max_dev(got, exp)
    got = torch.tensor(res["rank_eval_losses"][key], dtype=torch.float64).T  # (pass, rank)
    torch.testing.assert_close(got, torch.tensor(ref.eval_losses, dtype=torch.float64), **loss_tol,
                               msg=lambda m: f"{where}: forward-only losses\n{m}")
    torch.testing.assert_close(torch.tensor(r.grad_norms, dtype=torch.float64),
                               torch.tensor(ref.grad_norms, dtype=torch.float64), **loss_tol,
                               msg=lambda m: f"{where}: get_global_grad_norm()\n{m}")
    assert r.lrs == ref.lrs, (where, r.lrs, ref.lrs)
    assert list(r.state) == list(ref.state), f"{where}: state_dict keys differ"
    param_abs, param_rel = 0.0, 0.0
    for name, want in ref.state.items():
        torch.testing.assert_close(r.state[name], want.float(), **param_tol,
                                   msg=lambda m: f"{where}: {name} after {STEPS} steps\n{m}")
        a, rel = max_dev(r.state[name], want.float())
        param_abs, param_rel = max(param_abs, a), max(param_rel, rel)
    return loss_dev, param_abs, param_rel


FP32 = dict(rtol=1e-5, atol=1e-6)  # tests/test_parity.py says why
BF16_LOSS = dict(rtol=2e-2, atol=2e-3)
BF16_PARAM = dict(rtol=2e-2, atol=6e-3)


def assert_config_trains(res: dict, model: str, cname: str, world: int, where: str) -> None:
    """A run_world case of a named config (`config_named`) against one process, at its dtype's
    tolerance: no rank raised, it trains as `assert_trains_as` checks, and nothing a forward
    needed was found not gathered."""
    cfg, key = config_named(cname), (model, cname)
    assert not res["rank_errors"][key], f"{where}: a rank raised\n" + res["rank_errors"][key][0]
    ref = cached_reference(model, world, optimizer_for(cname), cfg.gradient_clipping)
    loss_tol, param_tol = (FP32, FP32) if cfg.compute_dtype == "fp32" else (BF16_LOSS, BF16_PARAM)
    assert_trains_as(res, key, ref, loss_tol, param_tol, where)
    assert not res["rank_not_available"][key], (where, res["rank_not_available"][key][:5])
