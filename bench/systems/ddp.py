"""DDP: torch's DistributedDataParallel on gloo, default buckets (25 MiB), its C++ all-reduce
(SUM, then divide by world size). In stats mode the same all-reduce goes through the Python
allreduce_hook so that the collective counter sees it (the C++ reducer bypasses Python)."""
from torch.nn.parallel import DistributedDataParallel

from systems.common import Plain, make_model


def build(rank: int, world: int, spec: dict) -> Plain:
    model = make_model(spec["model"])
    ddp = DistributedDataParallel(model)
    if spec["mode"] == "stats":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    return Plain(model, ddp, foreach=spec.get("options", {}).get("foreach"))
