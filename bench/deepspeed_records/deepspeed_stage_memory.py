"""Bytes per parameter per rank that real DeepSpeed 0.19.8 holds at ZeRO stages 0-3, in fp32,
bf16 and fp16, by kind (params as held, grads, fp32 masters, optimizer states, buffers), counted
from tensor storages rather than RSS. Runs on 2 CPU ranks (gloo) with bench/.env's DeepSpeed:

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 bench/.env/bin/torchrun --nproc_per_node 2 \
        bench/deepspeed_records/deepspeed_stage_memory.py --out tests/data/deepspeed_stage_memory_0.19.8.json

The model is 4 Linear(1024, 1024) layers (4,198,400 parameters; the weights are above the
default stage3_param_persistence_threshold, the biases below it). Each configuration trains one
accumulation window of 2 micro-steps, then a second (gradient_accumulation_steps 2, AdamW from
the JSON, DeepSpeed's defaults otherwise), counted in the second window, where optimizer states
exist: after its first backward (mid-window), after its boundary backward (the steady state the
ZeRO paper counts) and after its step.

Counting: every tensor reachable from the module's parameters (data, grad, ds_tensor) and,
recursively, from engine.optimizer's attributes and its torch optimizer's state; each storage
counted once (by data_ptr), under the first kind that reaches it in the order params, grads,
optimizer_states, fp32_master, buffers, other. A storage's bytes are its whole allocation:
DeepSpeed's IPG reduce buckets (reduce_bucket_size elements, torch.empty, never touched in full
on CPU) are counted under "buffers" and reported apart from the total they would dominate.
Every counted tensor is listed with the attribute path that reached it, so a reader can check
each classification. Theory is the ZeRO paper's accounting for Adam: params P, grads G, master
plus two moments K (bytes per param), divided by the world size N where the stage shards them.

fp16 needs DeepSpeed's CPU accelerator to say it supports fp16 (it asks mkldnn, which says no on
CPUs without AVX512-FP16): this script patches is_fp16_supported to True, as
bench/deepspeed_records/deepspeed_stages.sh does. build_shm_op is stubbed as in
bench/deepspeed_records/deepspeed_facts.py.
"""
import argparse
import importlib
import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import deepspeed  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402

importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
type(get_accelerator()).is_fp16_supported = lambda self: True

WIDTH, LAYERS = 1024, 4
POINTS = ("mid_window_after_backward", "boundary_after_backward", "after_step")
KINDS = ("params", "grads", "optimizer_states", "fp32_master", "buffers", "other")


def build(stage: int, precision: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
           "steps_per_print": 10**9, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine, cfg


def kind_of_attribute(path: str) -> str:
    """The kind of a tensor found under engine.optimizer, from DeepSpeed's attribute names
    (first match wins): ipg_buckets -> buffers; *grad* (averaged_gradients,
    grad_partitions_flat_buffer, fp32_groups_gradients_flat) -> grads; *fp32* / single_partition /
    hp_ -> fp32_master; bit16 / fp16 / lp_ / partitioned_param -> params."""
    p = path.lower()
    for kind, keys in (("buffers", ("ipg", "bucket")), ("grads", ("grad",)),
                       ("fp32_master", ("fp32", "single_partition", "hp_")),
                       ("params", ("bit16", "fp16", "lp_", "partitioned_param")), ("buffers", ("buffer",))):
        if any(k in p for k in keys):
            return kind
    return "other"


class Counter:
    def __init__(self) -> None:
        self.seen: dict[int, tuple[str, str, int]] = {}

    def add(self, t, kind: str, path: str) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in self.seen:
            return
        self.seen[storage.data_ptr()] = (kind, path, storage.nbytes())

    def walk(self, obj, path: str, depth: int, visited: set, kind=None) -> None:
        if depth > 6 or id(obj) in visited:
            return
        visited.add(id(obj))
        if isinstance(obj, torch.Tensor):
            self.add(obj, kind or kind_of_attribute(path), path)
            if obj.grad is not None:
                self.add(obj.grad, "grads", path + ".grad")
            return
        if isinstance(obj, dict):
            items = obj.items()
        elif isinstance(obj, (list, tuple)):
            items = enumerate(obj)
        elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("deepspeed"):
            items = vars(obj).items()
        else:
            return
        for k, v in items:
            self.walk(v, f"{path}.{k}", depth + 1, visited, kind)

    def totals(self) -> dict:
        out = {k: 0 for k in KINDS}
        for kind, _, nbytes in self.seen.values():
            out[kind] += nbytes
        return out


def count(engine) -> Counter:
    c = Counter()
    for name, p in engine.module.named_parameters():
        if hasattr(p, "ds_tensor"):
            c.add(p.ds_tensor, "params", f"module.{name}.ds_tensor")
            if p.numel() > 0:
                c.add(p.data, "params", f"module.{name}.data (gathered)")
        else:
            c.add(p.data, "params", f"module.{name}.data")
        if p.grad is not None:
            c.add(p.grad, "grads", f"module.{name}.grad")
    opt = engine.optimizer
    basic = getattr(opt, "optimizer", opt)
    for i, state in enumerate(basic.state.values()):
        for k, v in state.items():
            c.add(v, "optimizer_states", f"optimizer.state[{i}].{k}")
    visited = {id(engine.module)}
    for p in engine.module.parameters():
        visited.add(id(p))
    if opt is not basic:
        c.walk(opt, "optimizer", 0, visited)
    for i, group in enumerate(basic.param_groups):
        for j, p in enumerate(group["params"]):
            c.add(p, "fp32_master" if p.dtype == torch.float32 and opt is not basic else "params",
                  f"optimizer.param_groups[{i}][{j}]")
    return c


def measure(stage: int, precision: str, numel: int) -> dict:
    """Two accumulation windows of 2 micro-steps. Counted in the second window (optimizer states
    exist from the first): after its first backward (mid-window: stage 1 still holds whole
    gradients here), after its boundary backward, and after its step."""
    engine, cfg = build(stage, precision)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    labels = {2: "mid_window_after_backward", 3: "boundary_after_backward"}
    counts = {}
    for i in range(4):
        x = torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(i)).to(dtype)
        engine.backward(engine(x).float().pow(2).mean())
        if i in labels:
            counts[labels[i]] = count(engine)
        engine.step()
    counts["after_step"] = count(engine)
    row = {"config": cfg, "optimizer": type(engine.optimizer).__name__,
           "basic_optimizer": type(getattr(engine.optimizer, "optimizer", engine.optimizer)).__name__}
    for label, c in counts.items():
        totals = c.totals()
        row[label] = {
            "bytes": totals,
            "bytes_per_param": {k: round(v / numel, 4) for k, v in totals.items()},
            "total_per_param_without_buffers": round(sum(v for k, v in totals.items() if k != "buffers") / numel, 4),
            "tensors": sorted([kind, path, nbytes] for kind, path, nbytes in c.seen.values())}
    return row


def theory(stage: int, precision: str, world: int) -> dict:
    """ZeRO paper accounting (bytes/param/rank): P params + G grads + K optimizer (fp32 master
    only under mixed precision, + exp_avg + exp_avg_sq), sharded by stage."""
    p = g = 4 if precision == "fp32" else 2
    k = 8 if precision == "fp32" else 12
    shard = {0: (1, 1, 1), 1: (1, 1, world), 2: (1, world, world), 3: (world, world, world)}[stage]
    parts = {"params": p / shard[0], "grads": g / shard[1], "optimizer_incl_master": k / shard[2]}
    return {**parts, "total": sum(parts.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    deepspeed.init_distributed()
    world = dist.get_world_size()
    numel = LAYERS * (WIDTH * WIDTH + WIDTH)
    record = {"deepspeed_version": deepspeed.__version__, "torch_version": torch.__version__, "world_size": world,
              "model": f"{LAYERS} x Linear({WIDTH}, {WIDTH})", "numel": numel,
              "command": "DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 bench/.env/bin/torchrun --nproc_per_node 2 "
                         "bench/deepspeed_records/deepspeed_stage_memory.py --out tests/data/deepspeed_stage_memory_0.19.8.json",
              "runs": {}, "table": []}
    for precision in ("fp32", "bf16", "fp16"):
        for stage in (0, 1, 2, 3):
            name = f"{precision}_stage{stage}"
            try:
                row = measure(stage, precision, numel)
            except Exception as e:  # noqa: BLE001 - a refused configuration is a recorded fact
                row = {"error": {"type": type(e).__name__, "message": str(e)[:400]}}
            row["theory_bytes_per_param"] = theory(stage, precision, world)
            per_rank = [None] * world
            dist.all_gather_object(per_rank, {k: row[k]["total_per_param_without_buffers"] for k in POINTS if k in row})
            row["total_per_param_without_buffers_by_rank"] = per_rank
            record["runs"][name] = row
            if "after_step" in row:
                record["table"].append({"case": name, "optimizer": row["optimizer"],
                                        "theory": row["theory_bytes_per_param"]["total"],
                                        **{f"measured_{k}": row[k]["total_per_param_without_buffers"] for k in POINTS},
                                        **{f"by_kind_{k}": row[k]["bytes_per_param"] for k in POINTS}})
            if dist.get_rank() == 0:
                print(name, row.get("error") or {k: row[k]["bytes_per_param"] for k in POINTS},
                      flush=True)
    if dist.get_rank() == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
        print(f"wrote {args.out}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
