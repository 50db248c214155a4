"""What real DeepSpeed 0.19.8 does with offload keys on this machine (DS_ACCELERATOR=cpu, one
gloo rank), recorded as data fz3's CI checks against (issue #47: "offload at a stage that does
not support it in DeepSpeed", the devices and paths it refuses, what its CPU Adam computes):

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 bench/.env/bin/python bench/deepspeed_records/deepspeed_offload.py \
        --out tests/data/deepspeed_offload_0.19.8.json

Each case is one zero_optimization section on deepspeed_facts.py's model (BASE's other keys,
gas 1): deepspeed.initialize, then 3 steps on fixed data. Recorded per case: {"value": {"losses",
"optimizer": the class DeepSpeed built, "weights": a checksum}} or {"error": {type, message}},
with DeepSpeed's WARNING records. The same model, data and seed run without offload as "none".
"""
import argparse
import copy
import json
import os
import sys
import tempfile

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29531")
os.environ.setdefault("RANK", "0")
os.environ.setdefault("LOCAL_RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")
import torch  # noqa: E402

import deepspeed  # noqa: E402
from deepspeed_facts import BASE, Net, observe  # noqa: E402 - this folder's recorder: same model and helpers


def config(zero: dict, optimizer: str = "json") -> dict:
    cfg = copy.deepcopy(BASE)
    cfg.pop("scheduler")
    cfg.update(train_batch_size=2, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1)
    cfg["zero_optimization"] = {**{k: v for k, v in cfg["zero_optimization"].items() if k != "stage"}, **zero}
    if optimizer == "client":
        cfg.pop("optimizer")
        cfg["zero_force_ds_cpu_optimizer"] = False
    return cfg


def run(zero: dict, optimizer: str = "json") -> dict:
    torch.manual_seed(0)
    model = Net()
    client = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1) \
        if optimizer == "client" else None
    engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=client, config=config(zero, optimizer))
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        x = torch.randint(0, 16, (2,), generator=g)
        y = torch.randint(0, 16, (2,), generator=g)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    inner = getattr(opt, "optimizer", opt)
    out = {"losses": losses, "optimizer": type(inner).__name__}
    engine.destroy()
    return out


def cases(nvme: str) -> dict:
    cpu, nv = {"device": "cpu"}, {"device": "nvme", "nvme_path": nvme}
    c = {}
    for stage in (0, 1, 2, 3):
        c[f"stage{stage}_none"] = ({"stage": stage}, "json")
        c[f"stage{stage}_optimizer_cpu"] = ({"stage": stage, "offload_optimizer": cpu}, "json")
        c[f"stage{stage}_optimizer_cpu_client"] = ({"stage": stage, "offload_optimizer": cpu}, "client")
        c[f"stage{stage}_optimizer_nvme"] = ({"stage": stage, "offload_optimizer": nv}, "json")
        c[f"stage{stage}_param_cpu"] = ({"stage": stage, "offload_param": cpu}, "json")
        c[f"stage{stage}_param_nvme"] = ({"stage": stage, "offload_param": nv, "offload_optimizer": nv}, "json")
        c[f"stage{stage}_ratio_half"] = ({"stage": stage, "offload_optimizer": {**cpu, "ratio": 0.5}}, "json")
    c["device_gpu"] = ({"stage": 3, "offload_optimizer": {"device": "gpu"}}, "json")
    c["nvme_without_path"] = ({"stage": 3, "offload_optimizer": {"device": "nvme"}}, "json")
    c["nvme_path_missing"] = ({"stage": 3, "offload_optimizer": {"device": "nvme",
                                                                 "nvme_path": "/nonexistent/fz3"}}, "json")
    c["param_nvme_without_path"] = ({"stage": 3, "offload_param": {"device": "nvme"}}, "json")
    c["ratio_above_one"] = ({"stage": 3, "offload_optimizer": {**cpu, "ratio": 1.5}}, "json")
    return c


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default="")
    a = ap.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    nvme = tempfile.mkdtemp(prefix="ds-offload-")
    record = {"deepspeed": deepspeed.__version__, "torch": torch.__version__, "cases": {}}
    for name, (zero, optimizer) in cases(nvme).items():
        if a.only and a.only not in name:
            continue
        print(name, flush=True)
        record["cases"][name] = {"zero_optimization": zero, "optimizer": optimizer,
                                 **observe(lambda: run(zero, optimizer))}
        print("  ", json.dumps(record["cases"][name])[:300], flush=True)
    with open(a.out, "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
