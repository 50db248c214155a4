"""Observe what real DeepSpeed 0.19.8 does, and record it as data fz3's CI checks against
(DeepSpeed is not installed in CI). Runs on 2 CPU ranks (gloo) with bench/.env's DeepSpeed:

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 bench/.env/bin/torchrun --nproc_per_node 2 \
        bench/deepspeed_records/deepspeed_facts.py --out tests/data/deepspeed_facts_0.19.8.json

Sections of the JSON (docs/deepspeed_map.md §9 reads them out, one row per fact):
  auto          each key Hugging Face's ZeRO-3 JSON sets to "auto", set alone: the value the
                engine ends up with and what one accumulation window then does, or the error
  batch_sizes   which of train_batch_size / micro / gas are given, world size 2 -> derived or error
  engine        named_parameters, train()/eval(), no_sync, zero_grad mid-window, param.grad
  counters      global_steps, global_samples, micro_steps, skipped_steps, get_lr, boundary and
                was_step_applied at every point of 5 micro-steps with gas 2
  checkpoint    save_checkpoint files, load_checkpoint into a fresh engine (counters, get_lr,
                micro_steps), after a mid-window save, into the same engine, with no 'latest'
  save_16bit    save_16bit_model: files, ranks that write, keys, dtypes, tied weights, buffers
  overflow      a NaN gradient at the boundary: skipped step, counters, lr, weights
  initialize    client optimizer + JSON optimizer, training_data's dataloader, bad config paths
Every observation is {"value": ...} or {"error": {"type", "message"}}, plus "log" with the
DeepSpeed log records (WARNING and up, INFO where noted) that the call emitted.

DeepSpeed's TorchBackend JIT-compiles a shared-memory all-reduce op at init_distributed (~75 s,
used only by inference); build_shm_op is replaced by `lambda: None` (DeepSpeed's own "op
unavailable" path), as bench/systems/deepspeed_z3.py does.
"""
import argparse
import copy
import importlib
import json
import logging
import math
import os
import re
import shutil
import tempfile
import time
import traceback

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import deepspeed  # noqa: E402
from deepspeed.utils import logger as ds_logger  # noqa: E402

importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None

V, D = 16, 8
BASE = {
    "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
    "gradient_clipping": 0.5, "steps_per_print": 10**9, "wall_clock_breakdown": False,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.8, 0.9], "eps": 1e-6,
                                              "weight_decay": 0.1, "torch_adam": True}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01,
                                                      "warmup_num_steps": 3, "total_num_steps": 10,
                                                      "warmup_type": "linear"}},
    "bf16": {"enabled": False}, "fp16": {"enabled": False},
    # non-default values throughout, so that "auto" -> default shows (reduce_scatter's own case
    # flips it: AUTO_BASE_OVERRIDES)
    "zero_optimization": {"stage": 3, "reduce_bucket_size": 1000, "stage3_prefetch_bucket_size": 1000,
                          "stage3_param_persistence_threshold": 10, "stage3_max_live_parameters": 10**6,
                          "stage3_max_reuse_distance": 10**6, "stage3_gather_16bit_weights_on_model_save": True,
                          "overlap_comm": False, "contiguous_gradients": False, "reduce_scatter": True,
                          "sub_group_size": 10**6},
}


class Net(torch.nn.Module):
    """Tokens (B,) -> logits (B, 16); a persistent and a non-persistent buffer; head tied to the
    embedding when `tied`."""

    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(V, D)
        self.fc = torch.nn.Linear(D, D)
        self.head = torch.nn.Linear(D, V, bias=False)
        if tied:
            self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.full((D,), 0.5))
        self.register_buffer("scratch", torch.zeros(D), persistent=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)                                                    # (B, 8)
        # under bf16 DeepSpeed casts params, not buffers: scale stays fp32 (save_16bit shows it)
        h = torch.nn.functional.gelu(self.fc(h * self.scale.to(h.dtype)))  # (B, 8)
        return torch.nn.functional.cross_entropy(self.head(h), y)


# ---------------------------------------------------------------- observation helpers

class Capture(logging.Handler):
    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.levelname}: {record.getMessage()}")


def plain(v):
    """A JSON-friendly copy: tensors to lists, dtypes and odd objects to strings, nan/inf to
    strings."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, torch.Tensor):
        return plain(v.tolist())
    if isinstance(v, (list, tuple)):
        return [plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): plain(x) for k, x in v.items()}
    if hasattr(v, "model_dump"):
        return plain(v.model_dump())
    if hasattr(v, "value") and isinstance(getattr(v, "value"), (int, str)):
        return v.value
    return str(v)


def observe(fn, level: int = logging.WARNING) -> dict:
    """Run fn(); {"value": result} or {"error": {type, message}}, with the DeepSpeed log records."""
    cap = Capture(level)
    ds_logger.addHandler(cap)
    old = ds_logger.level
    ds_logger.setLevel(min(old, level))
    try:
        out = {"value": plain(fn())}
    except Exception as e:  # noqa: BLE001 - recording what DeepSpeed raises is the point
        last = traceback.extract_tb(e.__traceback__)[-1]
        where = last.filename.split("site-packages/")[-1].replace(os.getcwd() + "/", "")
        out = {"error": {"type": type(e).__name__, "message": str(e)[:600],
                         "raised_at": f"{where}:{last.lineno} {last.name}"}}
    finally:
        ds_logger.removeHandler(cap)
        ds_logger.setLevel(old)
    records = sorted(set(_tidy(r) for r in cap.records if SCHEDULER_WARNING not in r))
    if records:
        out["log"] = records
    return out


# WarmupLR's __init__ asks itself for the lr before its first step: every initialize with a
# WarmupLR-family JSON scheduler logs this (recorded once, in engine.initialize_log)
SCHEDULER_WARNING = "Attempting to get learning rate from scheduler before it has started"


def _tidy(record: str) -> str:
    """A log line without this run's temporary directory names."""
    return re.sub(r"/tmp/dsfacts_\w+", "<dir>", record)[:400]


def cfg_with(path: str, value, base: dict = BASE) -> dict:
    cfg = copy.deepcopy(base)
    *parents, last = path.split(".")
    node = cfg
    for p in parents:
        node = node.setdefault(p, {})
    if value is _DELETE:
        node.pop(last, None)
    else:
        node[last] = value
    return cfg


_DELETE = object()


def build(cfg: dict, tied: bool = False, seed: int = 0, **kw):
    torch.manual_seed(seed)
    model = Net(tied)
    engine, opt, dl, sched = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                  config=cfg, **kw)
    return engine


def batch(i: int, micro: int = 2):
    """Global micro-step i: this rank's `micro` tokens and targets (fixed, seed i)."""
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randint(0, V, (dist.get_world_size(), micro), generator=g)
    y = torch.randint(0, V, (dist.get_world_size(), micro), generator=g)
    r = dist.get_rank()
    return x[r], y[r]


def counters(e) -> dict:
    return {"global_steps": e.global_steps, "global_samples": e.global_samples, "micro_steps": e.micro_steps,
            "skipped_steps": e.skipped_steps, "lr": plain(e.get_lr()),
            "boundary": e.is_gradient_accumulation_boundary(), "was_step_applied": e.was_step_applied(),
            "global_grad_norm": plain(e.get_global_grad_norm())}


def micro_step(e, i: int, poison: bool = False, trace: list | None = None) -> float:
    x, y = batch(i, e.train_micro_batch_size_per_gpu())
    if trace is not None:
        trace.append({"at": f"m{i} before forward", **counters(e)})
    loss = e(x, y)
    if poison:
        loss = loss * float("nan")
    if trace is not None:
        trace.append({"at": f"m{i} after forward", **counters(e)})
    e.backward(loss)
    if trace is not None:
        trace.append({"at": f"m{i} after backward", **counters(e)})
    e.step()
    if trace is not None:
        trace.append({"at": f"m{i} after step", **counters(e)})
    return loss.item()


def gathered(e) -> dict:
    """name -> full fp32 value of each param (every rank)."""
    ps = list(e.module.parameters())
    with deepspeed.zero.GatheredParameters(ps, modifier_rank=None):
        return {n: p.detach().float().clone() for n, p in e.module.named_parameters()}


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def all_ranks(value) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def listing(root: str) -> list:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def shared_dir(tag: str) -> str:
    """A fresh directory, the same path on every rank."""
    path = all_ranks(tempfile.mkdtemp(prefix=f"dsfacts_{tag}_") if dist.get_rank() == 0 else None)[0]
    dist.barrier()
    return path


# ---------------------------------------------------------------- sections

def auto_section() -> dict:
    readers = {
        "train_batch_size": lambda e: e.train_batch_size(),
        "train_micro_batch_size_per_gpu": lambda e: e.train_micro_batch_size_per_gpu(),
        "gradient_accumulation_steps": lambda e: e.gradient_accumulation_steps(),
        "gradient_clipping": lambda e: e.gradient_clipping(),
        "bf16.enabled": lambda e: e.bfloat16_enabled(),
        "fp16.enabled": lambda e: e.fp16_enabled(),
        "amp.enabled": lambda e: e.amp_enabled(),
        "steps_per_print": lambda e: e.steps_per_print(),
        "wall_clock_breakdown": lambda e: e.wall_clock_breakdown(),
        "zero_optimization.stage": lambda e: e.zero_optimization_stage(),
    }
    for k in ("lr", "betas", "eps", "weight_decay"):
        readers[f"optimizer.params.{k}"] = lambda e, k=k: e.optimizer.optimizer.param_groups[0][k]
    for k, attr in (("warmup_min_lr", "min_lrs"), ("warmup_max_lr", "max_lrs"),
                    ("warmup_num_steps", "warmup_num_steps"), ("total_num_steps", "total_num_steps"),
                    ("warmup_type", "warmup_type")):
        readers[f"scheduler.params.{k}"] = lambda e, attr=attr: getattr(e.lr_scheduler, attr)
    for k, field in (("reduce_bucket_size", None), ("stage3_prefetch_bucket_size", "prefetch_bucket_size"),
                     ("stage3_param_persistence_threshold", "param_persistence_threshold"),
                     ("stage3_max_live_parameters", "max_live_parameters"),
                     ("stage3_max_reuse_distance", "max_reuse_distance"),
                     ("stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save"),
                     ("overlap_comm", None), ("contiguous_gradients", None), ("reduce_scatter", None),
                     ("sub_group_size", None), ("offload_optimizer.device", "offload_optimizer"),
                     ("offload_param.device", "offload_param")):
        readers[f"zero_optimization.{k}"] = lambda e, f=field or k: getattr(e._config.zero_config, f)
    out = {"base_config": BASE}
    for key, read in readers.items():
        base = BASE
        for k, v in AUTO_BASE_OVERRIDES.get(key, {}).items():
            base = cfg_with(k, v, base)
        row = {"base_value": _lookup(base, key)}
        if key in AUTO_BASE_OVERRIDES:
            row["base_overrides"] = AUTO_BASE_OVERRIDES[key]
        box = {}

        def init(key=key, read=read, base=base):
            box["e"] = build(cfg_with(key, "auto", base))
            return read(box["e"])
        row["initialize"] = observe(init)
        if "e" in box:
            row["one_window"] = observe(lambda: _window(box["e"]))
        out[key] = row
    return out


# the base a case starts from, where BASE's own value would hide what "auto" gives
AUTO_BASE_OVERRIDES = {"zero_optimization.reduce_scatter": {"zero_optimization.contiguous_gradients": True,
                                                            "zero_optimization.reduce_scatter": False}}


def _lookup(cfg: dict, key: str):
    node = cfg
    for p in key.split("."):
        if not isinstance(node, dict) or p not in node:
            return "(absent)"
        node = node[p]
    return node


def _window(e) -> dict:
    losses = [micro_step(e, i) for i in range(e.gradient_accumulation_steps())]
    return {"losses_finite": all(math.isfinite(x) for x in losses), "was_step_applied": e.was_step_applied(),
            "lr_after": plain(e.get_lr()), "global_steps": e.global_steps, "global_samples": e.global_samples}


def batch_section() -> dict:
    cases = [(8, 2, 2), (8, 2, None), (8, None, 2), (None, 2, 2), (8, None, None), (None, 2, None),
             (None, None, 2), (None, None, None), (8, 2, 3), (9, 2, None), (7, None, None), (8, 3, None),
             (2, 2, None), (8, None, 3), (0, 2, 2), (16, 2, None)]
    rows = []
    for tbs, mbs, gas in cases:
        cfg = copy.deepcopy(BASE)
        for k, v in (("train_batch_size", tbs), ("train_micro_batch_size_per_gpu", mbs),
                     ("gradient_accumulation_steps", gas)):
            if v is None:
                cfg.pop(k)
            else:
                cfg[k] = v
        got = observe(lambda cfg=cfg: _batch_values(build(cfg)))
        rows.append({"given": {"train_batch_size": tbs, "train_micro_batch_size_per_gpu": mbs,
                               "gradient_accumulation_steps": gas}, **got})
    return {"world_size": dist.get_world_size(), "cases": rows}


def _batch_values(e) -> dict:
    return {"train_batch_size": e.train_batch_size(), "train_micro_batch_size_per_gpu": e.train_micro_batch_size_per_gpu(),
            "gradient_accumulation_steps": e.gradient_accumulation_steps()}


def engine_section() -> dict:
    torch.manual_seed(0)
    model = Net()
    cap = Capture(logging.WARNING)
    ds_logger.addHandler(cap)
    e, opt, dl, sched = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=BASE)
    ds_logger.removeHandler(cap)
    out = {"initialize_log": sorted(set(cap.records)),"initialize_returns": [type(v).__name__ for v in (e, opt, dl, sched)],
           "returned_optimizer_is_engine.optimizer": opt is e.optimizer,
           "returned_lr_scheduler_is_engine.lr_scheduler": sched is e.lr_scheduler,
           "engine.module_is_model": e.module is model,
           "types": {"engine": type(e).__name__, "optimizer": type(e.optimizer).__name__,
                     "basic_optimizer": type(e.optimizer.optimizer).__name__,
                     "lr_scheduler": type(e.lr_scheduler).__name__}}
    out["named_parameters"] = [[n, list(p.shape), list(p.ds_shape), p.requires_grad, bool(getattr(p, "ds_persist", False))]
                               for n, p in e.named_parameters()]
    out["module_named_parameters"] = [n for n, _ in e.module.named_parameters()]
    out["parameters_count"] = len(list(e.parameters()))
    out["module_state_dict_outside_gather"] = observe(
        lambda: {k: list(v.shape) for k, v in e.module.state_dict().items()})
    out["accessors"] = {"gradient_accumulation_steps()": e.gradient_accumulation_steps(),
                        "train_micro_batch_size_per_gpu()": e.train_micro_batch_size_per_gpu(),
                        "train_batch_size()": e.train_batch_size(), "gradient_clipping()": e.gradient_clipping(),
                        "zero_optimization_stage()": e.zero_optimization_stage()}
    out["train()"] = observe(lambda: {"returned": repr(e.train()), "module.training": e.module.training})
    out["eval()"] = observe(lambda: {"returned": repr(e.eval()), "module.training": e.module.training,
                                     "fc.training": e.module.fc.training})
    out["train(False)"] = observe(lambda: {"returned": repr(e.train(False)), "module.training": e.module.training})
    e.train()
    out["no_sync()"] = observe(lambda: _enter(e.no_sync()))

    x, y = batch(0)
    loss = e(x, y)
    out["forward_returns"] = type(loss).__name__
    returned = e.backward(loss)
    out["backward_returns"] = {"type": type(returned).__name__, "returned_over_loss": returned.item() / loss.item()}
    out["param_grad_after_backward"] = {n: (None if p.grad is None else list(p.grad.shape))
                                        for n, p in e.module.named_parameters()}
    e.step()
    x, y = batch(1)
    e.backward(e(x, y))
    e.step()
    out["named_parameters_after_one_window"] = [[n, list(p.shape), bool(getattr(p, "ds_persist", False))]
                                                for n, p in e.named_parameters()]
    e.eval()
    with torch.no_grad():
        e(x, y)
    out["named_parameters_after_eval_forward"] = [[n, list(p.shape)] for n, p in e.named_parameters()]
    e.train()
    micro_step(e, 2)
    out["named_parameters_after_next_training_micro_step"] = [[n, list(p.shape)] for n, p in e.named_parameters()]
    out["zero_grad_mid_window"] = _zero_grad_effect()
    return out


def _enter(ctx):
    with ctx:
        return "entered"


def _zero_grad_effect() -> dict:
    """Two engines from the same init run the same window; one calls engine.zero_grad() after the
    first micro-step's backward and step. Equal weights after the boundary: zero_grad did not
    drop the first micro-batch's (already reduced and partitioned) gradient."""
    res = {}
    for name in ("plain", "zero_grad"):
        e = build(BASE)
        micro_step(e, 0)
        if name == "zero_grad":
            res["returned"] = repr(e.zero_grad())
        micro_step(e, 1)
        res[name] = gathered(e)
    third = build(BASE)   # the window with only the second micro-batch's gradient
    x, y = batch(1)
    third.micro_steps = 1
    loss = third(x, y)
    third.backward(loss)
    third.step()
    only_second = gathered(third)
    return {"zero_grad_returned": res["returned"],
            "max_abs_diff_vs_plain_window": max_diff(res["plain"], res["zero_grad"]),
            "max_abs_diff_vs_second_micro_batch_only": max_diff(only_second, res["zero_grad"])}


def counters_section() -> dict:
    e = build(BASE)
    trace = [{"at": "after initialize", **counters(e)}]
    for i in range(5):
        micro_step(e, i, trace=trace)
    return {"gradient_accumulation_steps": 2, "scheduler": BASE["scheduler"], "points": trace}


def checkpoint_section() -> dict:
    out = {}
    ref = build(BASE)
    for i in range(4):
        micro_step(ref, i)
    root = shared_dir("ckpt")
    out["save_checkpoint_returned"] = observe(lambda: ref.save_checkpoint(root, client_state={"epoch": 3}))
    dist.barrier()
    out["files"] = listing(root)
    out["latest"] = open(os.path.join(root, "latest")).read()
    cont_ref = [micro_step(ref, i) for i in (4, 5)]

    fresh = build(BASE, seed=1)
    out["fresh_before_load"] = counters(fresh)
    out["fresh_load_checkpoint"] = observe(lambda: _load(fresh, root))
    out["fresh_after_load"] = {**counters(fresh), "lr_scheduler.last_batch_iteration":
                               fresh.lr_scheduler.last_batch_iteration}
    trace = []
    cont = [micro_step(fresh, i, trace=trace) for i in (4, 5)]
    out["fresh_continues"] = {"points": trace, "losses_equal_uninterrupted": cont == cont_ref,
                              "losses": cont, "uninterrupted_losses": cont_ref,
                              "weights_max_abs_diff_vs_uninterrupted": max_diff(gathered(fresh), gathered(ref))}

    same = build(BASE)
    for i in range(4):
        micro_step(same, i)
    root2 = shared_dir("same")
    same.save_checkpoint(root2)
    out["same_engine_load"] = observe(lambda: _load(same, root2))
    out["same_engine_after_load"] = counters(same)
    cont_same = [micro_step(same, i) for i in (4, 5)]
    out["same_engine_losses_equal_uninterrupted"] = cont_same == cont_ref

    mid = build(BASE)
    for i in range(3):
        micro_step(mid, i)
    root3 = shared_dir("mid")
    mid.save_checkpoint(root3)
    out["mid_window_saved_at"] = counters(mid)
    mid_fresh = build(BASE, seed=1)
    mid_fresh.load_checkpoint(root3)
    out["mid_window_fresh_after_load"] = counters(mid_fresh)
    trace = []
    micro_step(mid_fresh, 3, trace=trace)
    out["mid_window_fresh_next_micro_step"] = trace

    keep_lr = build(BASE, seed=1)
    keep_lr.load_checkpoint(root, load_lr_scheduler_states=False)
    out["fresh_load_without_lr_scheduler_states"] = {**counters(keep_lr), "lr_scheduler.last_batch_iteration":
                                                     keep_lr.lr_scheduler.last_batch_iteration}
    keep_opt = build(BASE, seed=1)
    keep_opt.load_checkpoint(root, load_optimizer_states=False)
    out["fresh_load_without_optimizer_states"] = {**counters(keep_opt), "lr_scheduler.last_batch_iteration":
                                                  keep_opt.lr_scheduler.last_batch_iteration}

    empty = shared_dir("empty")
    out["load_without_latest"] = observe(lambda: _load(fresh, empty))
    out["load_missing_tag"] = observe(lambda: _load(fresh, root, tag="global_step999"))
    if dist.get_rank() == 0:
        for d in (root, root2, root3, empty):
            shutil.rmtree(d, ignore_errors=True)
    return out


def _load(e, root: str, **kw) -> dict:
    """load_checkpoint's two return values, readably: the path relative to root (per rank),
    the client_state's keys and the client's own entry."""
    path, client = e.load_checkpoint(root, **kw)
    return {"path_relative_per_rank": all_ranks(os.path.relpath(path, root) if path else None),
            "client_state_keys": sorted(client) if client is not None else None,
            "client_state_epoch": client.get("epoch") if client is not None else None}


def save16_section() -> dict:
    out = {}
    for label, bf16, gather in (("fp32_tied", False, True), ("bf16_tied", True, True), ("gather_false", False, False)):
        cfg = cfg_with("bf16.enabled", bf16)
        cfg = cfg_with("zero_optimization.stage3_gather_16bit_weights_on_model_save", gather, cfg)
        e = build(cfg, tied=True)
        micro_step(e, 0)
        micro_step(e, 1)
        root = shared_dir("s16")
        mine = os.path.join(root, f"rank{dist.get_rank()}")     # each rank its own dir: who writes?
        ret = observe(lambda: e.save_16bit_model(mine, "weights.bin"), level=logging.INFO)
        ret["log"] = [r for r in ret.get("log", []) if "sav" in r.lower()]
        full = gathered(e)
        dist.barrier()
        row = {"returned_per_rank": all_ranks(ret.get("value", ret.get("error"))), "call": ret,
               "files": listing(root)}
        path = os.path.join(root, "rank0", "weights.bin")
        if dist.get_rank() == 0 and os.path.exists(path):
            sd = torch.load(path, map_location="cpu", weights_only=False)
            row["loaded_type"] = type(sd).__name__
            row["keys"] = list(sd)
            row["tensors"] = {k: [str(v.dtype), list(v.shape)] for k, v in sd.items()}
            row["tied_same_object"] = sd["emb.weight"] is sd["head.weight"]
            row["tied_same_storage"] = sd["emb.weight"].data_ptr() == sd["head.weight"].data_ptr()
            row["max_abs_diff_vs_gathered_params"] = max(
                (sd[k].float() - full[k].to(sd[k].dtype).float()).abs().max().item() for k in full)
        out[label] = row
        if dist.get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)
    import inspect
    out["signature"] = str(inspect.signature(deepspeed.DeepSpeedEngine.save_16bit_model))
    return out


def overflow_section() -> dict:
    out = {}
    for label, bf16 in (("fp32", False), ("bf16", True)):
        e = build(cfg_with("bf16.enabled", bf16))
        micro_step(e, 0)
        micro_step(e, 1)
        before = gathered(e)
        trace = []
        cap = Capture(logging.WARNING)
        ds_logger.addHandler(cap)
        micro_step(e, 2, trace=trace)
        micro_step(e, 3, poison=True, trace=trace)
        ds_logger.removeHandler(cap)
        after = gathered(e)
        micro_step(e, 4, trace=trace)
        micro_step(e, 5, trace=trace)
        out[label] = {"nan_loss_at": "m3 (the boundary micro-step of the second window)", "points": trace,
                      "weights_changed_by_skipped_step": max_diff(before, after) > 0,
                      "log": sorted(set(cap.records))}
    return out


def initialize_section() -> dict:
    out = {}

    def both(kind=torch.optim.AdamW, cfg=BASE):
        torch.manual_seed(0)
        m = Net()
        opt = kind(m.parameters(), lr=0.5)
        e, o, _, s = deepspeed.initialize(model=m, optimizer=opt, config=cfg)
        return {"basic_optimizer": type(e.optimizer.optimizer).__name__,
                "basic_is_client_optimizer": e.optimizer.optimizer is opt, "lr": e.get_lr(),
                "lr_scheduler": type(s).__name__, "json_warmup_max_lr": getattr(s, "max_lrs", None)}
    out["client_optimizer_and_json_optimizer"] = observe(both)
    out["client_sgd_optimizer"] = observe(lambda: both(torch.optim.SGD, cfg_with("optimizer", _DELETE)))

    def both_sched():
        torch.manual_seed(0)
        m = Net()
        opt = torch.optim.AdamW(m.parameters(), lr=0.5)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        e, o, _, s = deepspeed.initialize(model=m, optimizer=opt, lr_scheduler=sched, config=BASE)
        return {"lr_scheduler": type(s).__name__, "is_client_scheduler": s is sched, "lr": e.get_lr()}
    out["client_scheduler_and_json_scheduler"] = observe(both_sched)
    no_opt = {}
    out["no_optimizer_anywhere_initialize"] = observe(lambda: _no_optimizer(no_opt))
    if "e" in no_opt:
        x, y = batch(0)
        out["no_optimizer_anywhere_backward"] = observe(lambda: no_opt["e"].backward(no_opt["e"](x, y)) and None)
    out["model_parameters_omitted_with_json_optimizer"] = observe(lambda: _no_model_parameters())
    out["training_data"] = observe(_training_data)
    out["config_path_missing"] = observe(lambda: build("/nonexistent/ds_config.json"))
    out["config_none"] = observe(lambda: build(None))
    out["config_and_args_deepspeed_config"] = observe(
        lambda: build(BASE, args=argparse.Namespace(deepspeed_config="x.json", local_rank=0)))
    out["unknown_top_level_key"] = observe(lambda: _batch_values(build(cfg_with("no_such_key", 1))))
    out["unknown_zero_key"] = observe(lambda: _batch_values(build(cfg_with("zero_optimization.no_such_key", 1))))
    both_off = {}

    def contiguous_and_reduce_scatter_off():
        cfg = cfg_with("zero_optimization.reduce_scatter", False, cfg_with("zero_optimization.contiguous_gradients", False))
        both_off["e"] = build(cfg)
        z = both_off["e"]._config.zero_config
        return {"contiguous_gradients": z.contiguous_gradients, "reduce_scatter": z.reduce_scatter}
    out["contiguous_gradients_false_reduce_scatter_false"] = observe(contiguous_and_reduce_scatter_off)
    if "e" in both_off:
        out["contiguous_gradients_false_reduce_scatter_false"]["one_window"] = observe(lambda: _window(both_off["e"]))
    out["amp_disabled"] = observe(lambda: _batch_values(build(cfg_with("amp", {"enabled": False}))))
    out["gradient_clipping_absent"] = observe(lambda: build(cfg_with("gradient_clipping", _DELETE)).gradient_clipping())
    out["json_path_config_number_types"] = observe(_json_path_types)
    return out


def _no_optimizer(box: dict):
    torch.manual_seed(0)
    box["e"], opt, _, sched = deepspeed.initialize(model=Net(), config=cfg_with("optimizer", _DELETE,
                                                                               cfg_with("scheduler", _DELETE)))
    return {"engine.optimizer": type(box["e"].optimizer).__name__, "returned_optimizer": type(opt).__name__,
            "returned_lr_scheduler": repr(sched)}


def _no_model_parameters():
    """model_parameters=None with a JSON optimizer: does one window still change the weights?"""
    torch.manual_seed(0)
    e, *_ = deepspeed.initialize(model=Net(), config=BASE)
    before = gathered(e)
    _window(e)
    return {"optimizer": type(e.optimizer).__name__, "weights_changed": max_diff(before, gathered(e)) > 0}


def json_adamw_section() -> dict:
    """The JSON "AdamW" without torch_adam, as HF's documented configs write it: on CPU DeepSpeed
    builds its FusedAdam (JIT-compiling the CPU fused_adam op the first time)."""
    cfg = copy.deepcopy(BASE)
    del cfg["optimizer"]["params"]["torch_adam"]
    box = {}

    def init():
        box["e"] = build(cfg)
        return {"basic_optimizer": f"{type(box['e'].optimizer.optimizer).__module__}."
                                   f"{type(box['e'].optimizer.optimizer).__name__}"}
    out = {"config_optimizer": cfg["optimizer"], "initialize": observe(init)}
    if "e" in box:
        out["one_window"] = observe(lambda: _window(box["e"]))
    return out


def _training_data():
    ds = torch.utils.data.TensorDataset(torch.arange(21))
    torch.manual_seed(0)
    m = Net()
    e, _, dl, _ = deepspeed.initialize(model=m, model_parameters=m.parameters(), training_data=ds, config=BASE)
    epochs = [[b[0].tolist() for b in dl] for _ in range(2)]
    s = dl.data_sampler
    return {"type": type(dl).__name__, "len": len(dl), "batch_size": dl.batch_size,
            "sampler": type(s).__name__, "sampler_shuffle": getattr(s, "shuffle", None),
            "sampler_seed": getattr(s, "seed", None), "sampler_drop_last": getattr(s, "drop_last", None),
            "dataloader_drop_last": dl.dataloader_drop_last, "num_local_io_workers": dl.num_local_io_workers,
            "pin_memory": dl.pin_memory, "batches_per_rank_epoch1": all_ranks(epochs[0]),
            "second_epoch_same_order": all(all_ranks(epochs[0] == epochs[1]))}


def _json_path_types():
    path = shared_dir("json")
    f = os.path.join(path, "ds.json")
    if dist.get_rank() == 0:
        json.dump(cfg_with("gradient_clipping", 1.0), open(f, "w"))
    dist.barrier()
    e = build(f)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    return {"gradient_clipping": repr(e.gradient_clipping()), "get_lr_before_step": repr(e.get_lr()),
            "warmup_min_lr": repr(e.lr_scheduler.min_lrs)}


def compact_json(v, indent: str = "") -> str:
    """json.dumps with indentation, but any list or dict that fits in 110 characters on one line."""
    flat = json.dumps(v)
    if len(flat) + len(indent) <= 110 or not isinstance(v, (list, dict)) or not v:
        return flat
    inner = indent + " "
    if isinstance(v, list):
        body = ",\n".join(inner + compact_json(x, inner) for x in v)
        return "[\n" + body + "\n" + indent + "]"
    body = ",\n".join(f"{inner}{json.dumps(k)}: {compact_json(x, inner)}" for k, x in v.items())
    return "{\n" + body + "\n" + indent + "}"


SECTIONS = {"auto": auto_section, "batch_sizes": batch_section, "engine": engine_section,
            "counters": counters_section, "checkpoint": checkpoint_section, "save_16bit": save16_section,
            "overflow": overflow_section, "initialize": initialize_section,
            "json_adamw": json_adamw_section}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/data/deepspeed_facts_0.19.8.json")
    ap.add_argument("--only", default=None, help="comma-separated section names")
    args = ap.parse_args()
    for h in ds_logger.handlers:
        h.setLevel(logging.ERROR)   # keep the console quiet; Capture sees what it asks for
    ds_logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")
    record = {"deepspeed_version": deepspeed.__version__, "torch_version": torch.__version__,
              "accelerator": os.environ["DS_ACCELERATOR"], "world_size": dist.get_world_size(),
              "command": "DS_ACCELERATOR=cpu bench/.env/bin/torchrun --nproc_per_node 2 bench/deepspeed_records/deepspeed_facts.py"}
    names = args.only.split(",") if args.only else list(SECTIONS)
    for name in names:
        t = time.time()
        record[name] = SECTIONS[name]()
        dist.barrier()
        if dist.get_rank() == 0:
            print(f"{name}: {time.time() - t:.1f} s", flush=True)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            f.write(compact_json(record) + "\n")
        print(f"wrote {args.out}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
