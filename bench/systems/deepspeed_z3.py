"""DeepSpeed ZeRO-3 on CPU: DS_ACCELERATOR=cpu, gloo (no oneCCL), the user's torch AdamW as a
client optimizer, fp32, stage-3 settings = DS_ZERO below (DeepSpeed's defaults, written out;
fz3's "same settings" run is Config.from_deepspeed of the same dict), gradient_clipping 0
(DeepSpeed 0.19.8 defaults it to 1.0; nothing else here clips).

The model is built outside zero.Init (zero.Init would skip GPT's custom init, docs/environment.md) and
partitioned by deepspeed.initialize. DeepSpeed's TorchBackend JIT-compiles a shared-memory
all-reduce op at init_distributed (~75 s, used only by inference all-reduce): build_shm_op is
replaced by `lambda: None` before init, which is DeepSpeed's own "op unavailable" path.
"""
from __future__ import annotations

import logging
import os

from systems.common import MODELS, loss_fn, make_model, make_optimizer, optimizer_state_tensors

DS_ZERO = {
    "stage": 3,
    "overlap_comm": True,
    "contiguous_gradients": True,
    "reduce_scatter": True,
    "reduce_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_param_persistence_threshold": 100_000,
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_max_reuse_distance": 1_000_000_000,
}


def ds_config(model: str, world: int, zero: dict | None = None) -> dict:
    global_batch = MODELS[model][1]
    return {"train_batch_size": global_batch, "train_micro_batch_size_per_gpu": global_batch // world,
            "gradient_accumulation_steps": 1, "zero_optimization": dict(zero or DS_ZERO),
            # DeepSpeed 0.19.8 clips at 1.0 unless told (GRADIENT_CLIPPING_DEFAULT); fz3's default
            # and the other systems do not clip: same optimizer for all
            "gradient_clipping": 0.0,
            "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
            "wall_clock_breakdown": False}


class DeepSpeedZ3:
    def __init__(self, spec: dict, world: int) -> None:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import importlib

        import deepspeed
        # not `import deepspeed.comm.torch as m`: that attribute path yields the torch package
        ds_torch_comm = importlib.import_module("deepspeed.comm.torch")
        from deepspeed.utils import logger
        logger.setLevel(logging.WARNING)
        ds_torch_comm.build_shm_op = lambda: None  # skip the ~75 s JIT build (see module doc)
        deepspeed.init_distributed(dist_backend="gloo")
        model = make_model(spec["model"])
        cfg = ds_config(spec["model"], world, spec.get("options", {}).get("zero"))
        optimizer = make_optimizer(model.parameters(), foreach=spec.get("options", {}).get("foreach"))
        self.engine, self.opt, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
        self.model = model

    def step(self, x, y) -> float:
        loss = loss_fn(self.engine(x), y)
        self.engine.backward(loss)
        self.engine.step()
        return loss.item()

    def memory(self) -> dict[str, list]:
        z = self.opt  # DeepSpeedZeroOptimizer_Stage3
        ps = list(self.model.parameters())
        params = [p.ds_tensor for p in ps] + [p.data for p in ps] + list(z.fp16_partitioned_groups_flat) \
            + list(z.fp32_partitioned_groups_flat)
        grads = [z.grad_partitions_flat_buffer] + [f.grad for f in z.fp32_partitioned_groups_flat]
        buffers = [b.buffer for b in z.ipg_buckets.values()]
        return {"params": params, "grads": grads, "optimizer": optimizer_state_tensors(z.optimizer),
                "comm_buffers": buffers}

    def extra(self, steps: int) -> dict:
        z = self.opt
        persistent = [p for p in self.model.parameters() if getattr(p, "ds_persist", False)]
        return {"persistent_params": len(persistent),
                "persistent_numel": sum(p.ds_numel for p in persistent),
                "ipg_buffer_numel": sum(b.buffer.numel() for b in z.ipg_buckets.values() if b.buffer is not None)}


def build(rank: int, world: int, spec: dict) -> DeepSpeedZ3:
    return DeepSpeedZ3(spec, world)
