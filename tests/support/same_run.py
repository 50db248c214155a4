"""Two runs' results equal to the bit: the losses, every full weight and every optimizer state
tensor (what the offload tests compare a run with offload against the same run without)."""
from __future__ import annotations

import torch


def assert_same_run(a: dict, b: dict) -> None:
    """`a` and `b` hold "losses", "weights" (engine.full_state_dict()) and "optimizer"
    (engine.full_optimizer_state_dict())."""
    assert a["losses"] == b["losses"]
    for k, v in a["weights"].items():
        assert torch.equal(b["weights"][k], v), k
    for i, entry in a["optimizer"]["state"].items():
        for k, v in entry.items():
            assert torch.equal(torch.as_tensor(b["optimizer"]["state"][i][k]), torch.as_tensor(v)), (i, k)
